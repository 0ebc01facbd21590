"""This rank's optimizer state as one dict, for torch's ``optimizer.state_dict()`` / ``load_state_dict()``
contract: hyperparameters, layout and this rank's shard of every master and state, loadable only at the same
world size and rank (__init__.py reshards across them). Built on [Note: checkpoint interface] in optimizer.py.
"""
from __future__ import annotations

from ...errors import TierstoreValueError

STATE_FORMAT = "tierstore.zero.optimizer/1"


def state_dict(opt) -> dict:
    """Zero3Optimizer.state_dict."""
    opt.check_usable("state_dict")
    return {"format": STATE_FORMAT, "world_size": opt.world_size, "rank": opt.rank,
            "layout": opt.layout.to_dict(), "param_groups": opt.hyperparams(),
            "subgroups": {gid: opt.export_subgroup(gid) for gid in opt.layout.trainable_gids()},
            "scaler": opt.scaler_state(), "steps": opt.steps}


def load_state_dict(opt, state_dict: dict) -> None:
    """Zero3Optimizer.load_state_dict."""
    opt.check_usable("load_state_dict")
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise TierstoreValueError("not a Zero3Optimizer state_dict (no 'format': "
                                  f"{STATE_FORMAT!r}); a plain torch optimizer's state cannot be loaded here")
    if (state_dict["world_size"], state_dict["rank"]) != (opt.world_size, opt.rank) or \
            state_dict["layout"] != opt.layout.to_dict():
        raise TierstoreValueError(
            f"this state_dict is rank {state_dict['rank']} of {state_dict['world_size']} with another layout; "
            f"this optimizer is rank {opt.rank} of {opt.world_size}. Use opt.save_checkpoint(dir) / "
            f"opt.load_checkpoint(dir), which reshard across world sizes")
    opt.set_hyperparams(state_dict["param_groups"])
    for gid, sg in state_dict["subgroups"].items():
        opt.import_subgroup(int(gid), sg["master"], sg["state"], sg["aux"])
    opt.load_scaler_state(state_dict["scaler"])
    opt.steps = state_dict.get("steps", 0)
    opt.coordinator.release_all()
