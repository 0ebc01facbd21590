"""The fp32 master stored as the bfloat16 parameter shard plus a 16-bit remainder.

[Note: split master]
With bfloat16 compute the parameter shard ``p{gid}`` is the master rounded to bfloat16: the master's upper
16 bits, give or take the rounding. Where the parameters and the optimizer states share a tier
(OffloadConfig(split_master=True); "auto", the default, where that tier is persistent -- on a memory tier it
would trade the in-place step for 2 bytes of memory; the shape of [Note: shared master] in shards.py) the master
``m{gid}`` is stored as the int16 *remainder* instead of fp32, so a trainable sub-group costs 2 + 2 bytes per
element, not 2 + 4 (on nvme: 2 bytes less read and written per parameter per step).
- ``split``: hi = master.to(bfloat16), torch's round-to-nearest-even -- the compute copy is exactly what it is
  without the split; diff = bits(master) - bits(float32(hi)) as int32 (the same sign bit, so the signed
  distance in fp32 bit units, |diff| <= 32768); lo = clamp(diff, -32767, 32767) as int16.
- ``join``: bits(master) = bits(float32(hi)) + lo.
The clamp: a tie (the master's low 16 bits exactly 0x8000, half way between two bfloat16 values) is rounded
to the even neighbour, either one, so diff takes 65537 values and one of them, +-32768, does not fit. The
clamp moves such a master one fp32 ulp towards hi (relative 2^-24; about one element in 65536 per step),
where it still rounds to the same hi: hi stays exactly RNE(master) and every other master comes back bit
for bit. NaN stays NaN (its hi is a NaN; the payload may change), +-inf and +-0 are exact.
Checkpoints, ``export_subgroup`` and the model's state dict see the joined fp32 master, so a checkpoint
saved with the split loads without it and the other way round. At world size 1 the bfloat16 bucket
backward releases is hi itself: the step takes it and reads only the remainder ([Note: masters at hand] in
stepper.py). The passes work chunk by chunk into the step's own buffers: one chunk of scratch, no full-size
temporary. The step joins on its compute thread into a recycled buffer and splits the stepped master back into
the loaded halves (on a memory tier the store's own resident copies, rewritten in place); memory tiers then step
one sub-group at a time, not all at once ([Note: one inner step for memory tiers] in stepper.py), so no fp32
copy of every master exists at once.
"""
from __future__ import annotations

import torch

from ...tiers import tier_info
from .. import keys

CHUNK = 1 << 18  # elements per pass: 1 MiB of fp32 scratch


def applies(config) -> bool:
    """Whether `config` stores masters split ([Note: split master])."""
    wanted = config.split_master is True or (config.split_master == "auto"
                                             and tier_info(config.optimizer_states).persistent)
    return bool(wanted and config.compute_dtype == torch.bfloat16 and config.params == config.optimizer_states)


def split(master: torch.Tensor | None, hi: torch.Tensor | None = None,
          lo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi bfloat16, lo int16) of the fp32 `master` (1-d), written into `hi` / `lo` where given."""
    assert master is not None  # a stepped sub-group's master_out
    master = master.reshape(-1)
    n = master.numel()
    hi = torch.empty(n, dtype=torch.bfloat16, device=master.device) if hi is None else hi.view(-1)
    lo = torch.empty(n, dtype=torch.int16, device=master.device) if lo is None else lo.view(-1)
    hi.copy_(master)
    scratch = torch.empty(min(n, CHUNK), dtype=torch.float32, device=master.device)
    bits = master.view(torch.int32)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        s = scratch[:b - a]
        s.copy_(hi[a:b])
        d = s.view(torch.int32)
        torch.sub(bits[a:b], d, out=d)
        d.clamp_(-32767, 32767)
        lo[a:b].copy_(d)
    return hi, lo


def join(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 master of `hi` and `lo` (into `out` where given)."""
    out = torch.empty(hi.numel(), dtype=torch.float32, device=hi.device) if out is None else out
    flat, lo = out.view(-1), lo.reshape(-1)
    flat.copy_(hi.reshape(-1))
    bits = flat.view(torch.int32)
    scratch = torch.empty(min(lo.numel(), CHUNK), dtype=torch.int32, device=out.device)
    for a in range(0, lo.numel(), CHUNK):  # widened a chunk at a time: twice as fast as a mixed-dtype add_
        b = min(lo.numel(), a + CHUNK)
        s = scratch[:b - a]
        s.copy_(lo[a:b])
        bits[a:b].add_(s)
    return out


def put(store, config, gid: int, master: torch.Tensor) -> None:
    """Store trainable sub-group `gid`'s fp32 `master`: hi as its parameter shard, lo as its master."""
    hi, lo = split(master.reshape(-1))
    store.put(keys.param(gid), hi, tier=config.params)
    store.put(keys.master(gid), lo, tier=config.optimizer_states)


def get(store, gid: int, device=None) -> torch.Tensor:
    """Trainable sub-group `gid`'s fp32 master, joined from the store (a copy)."""
    got = store.get_many([keys.param(gid), keys.master(gid)], device=device)
    return join(got[keys.param(gid)], got[keys.master(gid)])


def roles(gid: int, config, at_hand: torch.Tensor | None) -> list[tuple[str, str, str]]:
    """The step's load of a split master: the remainder, and hi unless it is at hand."""
    hi = [] if at_hand is not None else [("hi", keys.param(gid), config.params)]
    return [("lo", keys.master(gid), config.optimizer_states)] + hi


def joined(t, buffers) -> torch.Tensor:
    """The master of the loaded sub-group `t` (stepper.LoadedSubgroup), joined from its "hi" and "lo" the first
    time into a buffer of `buffers`, or where they are on another device (resident on a memory tier the step
    runs on) into memory of that device, left out of the buffers given back (counted with the resident)."""
    got = t.tensors
    if "master" not in got:
        lo = got["lo"]
        if lo.device == buffers.device:
            out = buffers.take(lo.numel(), torch.float32)
        else:
            out = torch.empty(lo.numel(), dtype=torch.float32, device=lo.device)
            t.resident.add("master")
        got["master"] = join(got["hi"], lo, out=out)
    return got["master"]


def save(store, disk, config, t, back) -> None:
    """Write the stepped sub-group `t`'s hi and lo (split by the step into its loaded ones) where they are not
    the store's own resident copies; each write is lent its buffer (`back`, stepper.Returns)."""
    for role, name, tier in (("hi", keys.param(t.gid), config.params),
                             ("lo", keys.master(t.gid), config.optimizer_states)):
        if role not in t.resident:
            store.put(name, t.tensors[role], tier=tier, lend=back.lend())
            disk.count(name, write=True)
