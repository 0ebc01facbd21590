"""Events of the ZeRO-3 hooks that other features subscribe to instead of adding state to the coordinator
(activation offload follows the forward trace and the backward cursor; hpZ the end of forward; the
overlapped step, the masters at hand and the stepped masters kept for the forward, gradient clipping).

[Note: hook events]
A subscriber is any object with some of ``HookEvents``' methods (subclass it to get no-ops for the rest);
``ParamCoordinator.subscribe`` adds it and returns a handle whose ``remove()`` takes it back. Events come on
the main thread, in this order for one training step:
- ``forward_begin()``: the model's forward starts (not for a forward recomputed inside backward);
- ``module_enter(module, index)``: a hooked module's forward starts, its buckets gathered; ``index`` is its
  position in the forward's trace (the same on every rank), None for a call recomputed inside backward;
- ``module_exit(module, index, entry)``: it ended, before its buckets are released; ``entry`` is the index
  of the backward entry it made ([Note: backward gathers] in backward_schedule.py), None when its output
  needs no gradient or it ran inside backward;
- ``forward_end()``: the model's forward ended, after what it fetched ahead was dropped;
- ``backward_begin(entries)``: the first backward hook of a backward ran; ``entries`` is how many there are;
- ``backward_visit(entry)``: the backward cursor reached ``entry`` (its buckets gathered), from the last
  entry down, the same visits in the same order on every rank; the final walk that the end of backward
  makes over the entries left is not reported;
- ``backward_end(aborted)``: the backward's reductions are done and its state reset; ``aborted``: it raised
  and this is the clean-up the next forward made.
Within backward, interleaved with the visits:
- ``gradient_open(gid)``: a gradient is about to be added into sub-group ``gid``'s partition (a reduction,
  or a gradient computed straight into it); a subscriber refuses it by raising MisuseError (a clip is
  pending: [Note: clipping with the loss scale] in scaling.py). Sent by the gradient partitions
  (grad_partitions.py), which the optimizer gives the coordinator's subscribers;
- ``bucket_final(gid)``: bucket ``gid``'s gradient is final and whole -- reduced, every trainable parameter
  of it had its gradient, nothing can add to it any more -- and its partition is handed over: the
  subscriber steps it now ([Note: overlapped step] in overlap.py). Sent only while some subscriber's
  ``wants_final()`` says True, and that query changes what the coordinator does: the reductions hand the
  partitions over instead of storing them, and at world size N it posts the agreement of [Note: overlapped
  step at world size N] in finals.py. With nobody wanting them, buckets are reduced into the store and
  step() steps them;
- ``bucket_released(gid, full)``: world size 1, backward released bucket ``gid`` and ``full`` is its values,
  this rank's own copy (not a shard the store lent): a subscriber may keep it ([Note: masters at hand] in
  stepper.py). Looked up and sent only when some subscriber defines the method (``listens``), so that
  without one no release holds the values a moment longer.
An exception in a subscriber propagates out of the hook, as an error of the model's own code would.
"""
from __future__ import annotations

import torch


class HookEvents:
    """What a subscriber can hear; every method does nothing here. See [Note: hook events]."""

    def forward_begin(self) -> None:
        pass

    def module_enter(self, module: torch.nn.Module, index: int | None) -> None:
        pass

    def module_exit(self, module: torch.nn.Module, index: int | None, entry: int | None) -> None:
        pass

    def forward_end(self) -> None:
        pass

    def backward_begin(self, entries: int) -> None:
        pass

    def backward_visit(self, entry: int) -> None:
        pass

    def backward_end(self, aborted: bool) -> None:
        pass

    def gradient_open(self, gid: int) -> None:
        pass

    def wants_final(self) -> bool:
        """Whether this subscriber steps final buckets now (``bucket_final``)."""
        return False

    def bucket_final(self, gid: int) -> None:
        pass

    def bucket_released(self, gid: int, full: torch.Tensor) -> None:
        pass


class Subscribers:
    """The coordinator's subscribers, called in the order they subscribed."""

    def __init__(self) -> None:
        self._subs: list = []

    def __bool__(self) -> bool:
        return bool(self._subs)

    def add(self, subscriber) -> Subscription:
        self._subs.append(subscriber)
        return Subscription(self, subscriber)

    def discard(self, subscriber) -> None:
        self._subs = [s for s in self._subs if s is not subscriber]

    def wants_final(self) -> bool:
        """Whether some subscriber steps final buckets now ([Note: hook events])."""
        return any(s.wants_final() for s in self._subs if hasattr(s, "wants_final"))

    def listens(self, event: str) -> bool:
        """Whether some subscriber defines `event` (not HookEvents' no-op)."""
        default = getattr(HookEvents, event, None)
        return any(getattr(type(s), event, default) is not default for s in self._subs)

    def emit(self, event: str, *args) -> None:
        for s in tuple(self._subs):
            fn = getattr(s, event, None)
            if fn is not None:
                fn(*args)


class Subscription:
    """Handle of one subscriber: ``remove()`` unsubscribes it."""

    def __init__(self, subscribers: Subscribers, subscriber):
        self._subscribers = subscribers
        self.subscriber = subscriber

    def remove(self) -> None:
        self._subscribers.discard(self.subscriber)
