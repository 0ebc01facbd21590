"""What each step multiplies the gradients by: the fp16 dynamic loss scale and gradient clipping (exact, or
with the previous step's norm), and the checks that keep both exact.

[Note: clipping with the loss scale]
The gradient partitions hold the reduced gradients times the fp16 loss scale (1 without float16), and are
not rewritten to clip them: the step multiplies each sub-group's gradient by one coefficient, the clip
coefficient over the loss scale. ``clip_grad_norm_`` takes the global L2 norm (an all_reduce of the ranks'
sums of squares, unscaled) and sets the clip coefficient that step() applies; ``clip_grad_value_`` clamps the
partitions at once, at the bound times the scale over a pending clip coefficient. From a norm clip to the
step, a gradient that arrived would be multiplied by a coefficient computed without it, so it is refused:
the coordinator's subscribers hear ``gradient_open`` before any gradient enters a partition ([Note: hook
events] in events.py) and this raises there. With float16 the step first checks every rank's partitions for
a non-finite value; one skips the step, halves the scale and forgets the gradients, as torch's GradScaler
does. clip_mode="previous_norm" ([Note: overlapped step] in overlap.py) keeps each clip_grad_norm_'s
(max_norm, norm) for the step after the next one, whose coefficient is then known before backward.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from ...errors import MisuseError, TierstoreValueError
from .. import _dist
from ..hooks.events import HookEvents
from .grad_partitions import OVERLAPPED, GradPartitions

log = logging.getLogger("tierstore.zero")


class LossScaler:
    """fp16 dynamic loss scaling: halve on overflow (and skip the step), double after `window` good steps."""

    def __init__(self, enabled: bool, scale: float, window: int, min_scale: float):
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.window = window
        self.min_scale = min_scale
        self.good = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good = 0
            self.skipped += 1
            log.info("fp16 overflow: step skipped, loss scale now %g", self.scale)
        else:
            self.good += 1
            if self.good >= self.window:
                self.scale *= 2
                self.good = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        if self.enabled:
            self.scale, self.good, self.skipped = d["scale"], d["good"], d["skipped"]


class GradScaling(HookEvents):
    """The loss scaler and the clip pending for the next step of one optimizer ([Note: clipping with the loss
    scale]). `overlap_spent()`: whether a backward since zero_grad() may have stepped sub-groups already."""

    def __init__(self, config, grads: GradPartitions, group, overlap_spent: Callable[[], bool]):
        self.config = config
        self.grads = grads
        self.group = group
        self.overlap_spent = overlap_spent
        fp16 = config.compute_dtype == torch.float16
        self.scaler = LossScaler(fp16, config.initial_loss_scale, config.loss_scale_window, config.min_loss_scale)
        self.clip_coef = 1.0
        self.clipped = False  # clip_grad_norm_ called since the last step (then config.gradient_clipping waits)
        self.touched = False  # some clip (by norm or by value) since the last step ([Note: the overlapped step by
        # default] in overlap.py)
        self._next_clip: tuple[float, float] | None = None  # clip_mode="previous_norm": (max_norm, norm) of the
        self._prev_clip: tuple[float, float] | None = None  # last clip_grad_norm_; ... of the one before this step
        # norms read at every step: the fp16 overflow check, clipping with the previous norm
        grads.eager = fp16 or config.clip_mode == "previous_norm"

    def gradient_open(self, gid: int) -> None:
        """Refuse a gradient that arrives after a pending clip ([Note: clipping with the loss scale])."""
        if self.clip_coef != 1.0:
            raise MisuseError("a gradient arrived after the gradients were clipped (clip_grad_norm_) and before "
                              "step(): the clip is applied inside the step, to every gradient, so it would scale "
                              "this one too. Clip once, after the last backward before step()")

    def global_grad_stats(self) -> tuple[float, bool]:
        """(global sum of squares of the scaled gradients, whether some rank's gradient is not finite)."""
        sq, bad = self.grads.sum_squares()
        t = torch.tensor([sq if math.isfinite(sq) else 0.0, float(bad)], dtype=torch.float64)
        _dist.all_reduce_sum(t, self.group)
        return float(t[0]), bool(t[1] > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Zero3Optimizer.clip_grad_norm_."""
        if float(norm_type) != 2.0:
            raise TierstoreValueError(f"norm_type={norm_type}: only the L2 norm (2.0) is supported")
        previous = self.config.clip_mode == "previous_norm"
        self.touched = True
        if self.overlap_spent() and not previous:
            raise MisuseError(f"clip_grad_norm_ after a backward that already stepped sub-groups ({OVERLAPPED}): "
                              "their step cannot be clipped any more. Use OffloadConfig(clip_mode='previous_norm') "
                              "to clip overlapped steps with the previous step's norm, or overlap_step=False for "
                              "exact clipping")
        sq, overflow = self.global_grad_stats()
        total = math.sqrt(sq) / self.scaler.scale * self.clip_coef
        if overflow:
            total = float("inf")
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               f"non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               f"by the non-finite norm anyway, set `error_if_nonfinite=False`")
        norm = torch.tensor(total)  # float32, as torch's clip_grad_norm_ returns it
        # previous_norm: the next step clips with the norm this returns, so that the user's own arithmetic on it
        # (as the tests' reference does) gives the same coefficient to the last bit
        self.clip_with_norm(max_norm, float(norm) if previous else total)
        self.clipped = True
        return norm

    def clip_with_norm(self, max_norm: float, total: float) -> None:
        self.touched = True
        if self.config.clip_mode == "previous_norm":  # [Note: overlapped step] in overlap.py
            self._next_clip = (max_norm, total)
        elif math.isfinite(total):
            self.clip_coef *= min(1.0, max_norm / (total + 1e-6))

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Zero3Optimizer.clip_grad_value_."""
        self.touched = True
        if self.overlap_spent():
            raise MisuseError(f"clip_grad_value_ after a backward that already stepped sub-groups ({OVERLAPPED}): "
                              "their gradients are spent. Use OffloadConfig(overlap_step=False) to clip by value")
        self.grads.clamp_(float(clip_value) * self.scaler.scale / self.clip_coef)

    def step_coef(self) -> float:
        """What this step multiplies the gradients by (clipping, loss scale)."""
        if self.config.clip_mode == "previous_norm":
            if self._prev_clip is None:
                return 1.0 / self.scaler.scale
            max_norm, total = self._prev_clip
            return (min(1.0, max_norm / (total + 1e-6)) if math.isfinite(total) else 1.0) / self.scaler.scale
        return self.clip_coef / self.scaler.scale

    def overflowed(self) -> bool:
        """float16: whether some rank's gradient overflowed; then the step is skipped and the scale halved."""
        if not self.scaler.enabled:
            return False
        _sq, overflow = self.global_grad_stats()
        if overflow:
            self.scaler.update(True)
            self.clip_coef = 1.0
        return overflow

    def stepped(self) -> None:
        """The step is done: the scale may grow, and the clip it applied is spent."""
        self.scaler.update(False)
        self.clip_coef = 1.0
        self._prev_clip, self._next_clip = self._next_clip, None
        self.clipped = self.touched = False

    def zero_grad(self) -> None:
        self.clip_coef = 1.0
        self.clipped = False
