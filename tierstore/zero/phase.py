"""Where the ZeRO-3 hooks are in a training step.

[Note: phases]
The coordinator is in one of three phases, and every hook decides by it:
- IDLE: no forward and no backward runs (between steps, in the optimizer's step, in ``opt.gathered()``);
- FORWARD: the model's forward runs (the root module's pre-hook fired and its post-hook has not yet). Hooked
  calls are observed by the trace, become the entries of [Note: backward gathers] (backward_schedule.py),
  and release their buckets when they end;
- BACKWARD: from the first backward hook of a backward (a gradient hook on a module's output, or a
  parameter's gradient landing) until its end-of-backward callback ran. A forward that runs inside it is
  activation recomputation ([Note: activation recomputation] in hooks/coordinator.py): not traced, not an entry,
  releasing nothing when it ends.
A backward that starts while a forward runs (the forward calls backward itself) returns to FORWARD at its
end. A backward that raised never runs its end callback: the next forward finds the phase still BACKWARD
under another autograd graph task and cleans up first. How deep the root's forward calls are nested is a
count kept beside the phase, not a phase.
"""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
