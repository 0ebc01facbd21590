"""GatheredParameters: full values of chosen parameters for a while, whether zero.Init offloaded them or a
Zero3Optimizer partitions them; with ``modifier_rank`` the writes made inside are kept.

[Note: gathered parameters]
``with GatheredParameters(params, modifier_rank=r):`` is a collective (every rank enters it with the same
parameters, in the same order). Inside, every given parameter holds its full value: one built under
zero.Init and not yet taken by an optimizer is brought back in a materialisation scope ([Note:
initialisation right by construction] in init.py); one a Zero3Optimizer manages is gathered by the
optimizer (``opt.gathered(params, modifier_rank=r)``). On exit, with ``modifier_rank=r``, rank r's values are
broadcast to every rank and written back -- into the Init store, or into the optimizer's shards and fp32
masters -- so a change made there (a re-initialisation, a surgical edit, a loaded tensor) is the model's
from then on; with ``modifier_rank=None`` (the default) the changes are dropped: use it to read (evaluate,
export). Parameters neither offloaded nor managed are left as they are. An exception inside the block
drops the changes too. Other offloaded parameters touched inside the block are brought back into the same
scope and follow the same rule.
"""
from __future__ import annotations

from contextlib import ExitStack

import torch

from . import registry
from .init import OffloadedParameter, _materialize, _Scope


class GatheredParameters:
    """See [Note: gathered parameters]. params: a Parameter or an iterable of them; modifier_rank: the rank
    whose writes are kept (None: none are); enabled=False makes it a no-op."""

    def __init__(self, params, modifier_rank: int | None = None, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stack: ExitStack | None = None
        self._scope: _Scope | None = None

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        stack = ExitStack()
        try:
            ids = {id(p) for p in self.params}
            for opt in registry.owners(ids):
                mine = [p for p in self.params if id(p) in opt.managed_param_ids()]
                stack.enter_context(opt.gathered(mine, modifier_rank=self.modifier_rank))
            scope = _Scope(keep=self.modifier_rank is not None, src=self.modifier_rank)
            stack.enter_context(scope)
            self._scope = scope
            for p in self.params:
                if isinstance(p, OffloadedParameter) and hasattr(p, "_tierstore_init"):
                    _materialize(p, GatheredParameters)
        except BaseException:
            stack.__exit__(None, None, None)
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is None:
            return
        if exc[0] is not None and self._scope is not None:
            self._scope.keep = False  # an exception inside: the changes are dropped
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)
