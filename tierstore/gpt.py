"""What the demo and the benchmarks share: a GPT-style model family, real text that ships with the machine,
and the measurements of a training step (time split, bytes per tier and kind, resident memory).

Standard library only at import (torch is imported inside the functions), never the rest of tierstore: the
DeepSpeed worker of `bench optim` loads this file by path from a venv without tierstore
(bench/_harness.py).
"""
from __future__ import annotations

import os
import sysconfig
import time

VOCAB = 256  # byte-level tokens
HEAD = 64  # elements per attention head
WIDE = 1024  # the family's width from ~50M parameters up: it grows deeper, each layer the same size


def shape_for(params: float) -> tuple[int, int]:
    """(width, layers) of the family member with about `params` parameters (12 * width^2 per layer).

    From ~50M up the width stays WIDE and layers are added, so what one layer gathers -- and the memory it
    needs -- does not grow with the model; below that, 4 layers of a narrower width."""
    if params >= 4 * 12 * WIDE * WIDE:
        return WIDE, max(1, round(params / (12 * WIDE * WIDE)))
    width = max(HEAD, HEAD * round((params / 48) ** 0.5 / HEAD))
    return width, 4


def build_model(width: int, layers: int, context: int, *, checkpoint: bool = False):
    """A GPT: token and position embeddings, pre-norm blocks (causal attention, 4x MLP), a head tied to the
    token embedding. Every module holding parameters is a leaf (nn.Linear, nn.LayerNorm, nn.Embedding), so
    the ZeRO-3 hooks' module_enter / module_exit bracket exactly one module's compute. checkpoint: run each
    block under torch.utils.checkpoint (only its input is kept for backward, which recomputes the rest):
    the memory of the activations then grows by one tensor per layer, not twenty."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.checkpoint

    if width % HEAD:
        raise ValueError(f"width {width} must be a multiple of {HEAD}")

    class Embedding(nn.Embedding):
        def reset_parameters(self):  # GPT-2's N(0, 0.02): the head shares this weight, N(0, 1) logits are huge
            nn.init.normal_(self.weight, std=0.02)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)
            # GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the two projections that add into the
            # residual stream scaled by 1/sqrt(2 x layers). With torch's default (uniform, fan-in) init the
            # stream's variance grows with depth and a deep model diverges in its first steps (a 1B, 83-layer
            # model went 5.55 -> 6.22 -> 10.2 in three steps of bench scale).
            for lin in (self.qkv, self.proj, self.up, self.down):
                std = 0.02 / math.sqrt(2 * layers) if lin in (self.proj, self.down) else 0.02
                nn.init.normal_(lin.weight, std=std)
                nn.init.zeros_(lin.bias)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, d // HEAD, HEAD).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embedding(VOCAB, width)
            self.pos = Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied: one parameter, two modules

        def forward(self, idx):
            x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) if checkpoint and \
                    torch.is_grad_enabled() else blk(x)
            return self.head(self.ln(x))

    return GPT()


def count_params(width: int, layers: int, context: int) -> int:  # elements
    per_layer = 4 * width + 3 * width * width + 3 * width + width * width + width + 8 * width * width + 5 * width
    return VOCAB * width + context * width + layers * per_layer + 2 * width


def stdlib_text(nbytes: int) -> tuple[bytes, int, str]:
    """Up to `nbytes` of the Python standard library's own sources (site-packages and tests left out), in a
    fixed order: (text, files read, directory). Real text on every machine with Python, no download."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, n, files = [], 0, 0
    for d, dirs, fs in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "test", "tests",
                                                     "idlelib", "__pycache__"))
        for f in sorted(fs):
            if not f.endswith(".py"):
                continue
            with open(os.path.join(d, f), "rb") as fh:
                data = fh.read()
            chunks.append(data)
            n += len(data)
            files += 1
            if n >= nbytes:
                return b"".join(chunks)[:nbytes], files, root
    return b"".join(chunks), files, root


def batches(text: bytes, steps: int, batch: int, context: int, seed: int = 1):
    """`steps` (inputs, targets) pairs of `batch` random windows of `context` bytes, the same for a seed."""
    import torch

    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)  # widened per batch: 8x less memory
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        st = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        out.append((torch.stack([data[s:s + context] for s in st]).long(), torch.stack([data[s + 1:s + 1 + context]
                                                                                    for s in st]).long()))
    return out


def keep_heap_small() -> None:
    """Make freed large blocks go back to the system (glibc; elsewhere nothing to do).

    [Note: resident memory follows live memory]
    glibc serves a large malloc with its own mmap and unmaps it on free -- until a free of such a block
    raises its threshold (up to 32 MiB), after which blocks of that size come from the heap and stay
    resident when freed. A training step frees and allocates blocks of a layer's size all the time
    (gathered parameters, gradients, sub-group buffers), so resident memory would measure the most ever
    allocated, not what is alive. A fixed threshold of 1 MiB keeps the two close, at the cost of an mmap per
    large block (small next to moving it to or from disk)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: bytes
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: bytes
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    """Start VmHWM over from the current resident size (Linux: clear_refs 5), so a later peak is this
    phase's, not an earlier one's. Nothing happens where that is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def proc_status(field: str) -> int:  # bytes
    """A size from /proc/self/status (Linux), e.g. VmRSS (resident now) or VmHWM (the most resident so far).
    Here (stdlib only) so the DeepSpeed worker, loading this file by path, has it too."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no field {field!r}")


def ram_bytes() -> int:  # bytes
    """The machine's RAM (MemTotal)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def dir_bytes(path: str) -> int:  # bytes: what the files under `path` occupy on disk (allocated blocks)
    total = 0
    for d, _dirs, fs in os.walk(path):
        for f in fs:
            try:
                total += os.stat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


KINDS = {"p": "parameters", "g": "gradients", "m": "fp32 master", "s": "optimizer states"}


def bytes_by_tier_and_kind(store) -> dict[str, dict[str, int]]:
    """{kind: {tier: bytes}} of what `store` holds now, each copy counted on its tier (nvme: bytes as stored,
    8-bit states encoded). The kind comes from the optimizer's key names (p*, g*, m*, s*)."""
    out: dict[str, dict[str, int]] = {}
    for name in store.keys():
        t = store.tensor(name)
        kind = KINDS.get(name[:1], "other")
        for tier in t.tiers:
            nb = (t.encoded_nbytes or 0) if tier == "nvme" else t.nbytes
            out.setdefault(kind, {}).setdefault(tier, 0)
            out[kind][tier] += nb
    return out


class StepClock:
    """Splits forward + backward into module compute and the rest (waiting for parameters to be read and
    gathered), measured with hooks of the ZeRO-3 coordinator and of torch.

    [Note: measuring the time split]
    Forward: the coordinator's ``module_enter`` event comes after a module's parameters are gathered and
    ``module_exit`` before they are released, so enter -> exit is that module's compute (every module with
    parameters is a leaf in build_model). Backward: a hook registered on each such module's output after the
    coordinator's own (which gathers the parameters) marks the start of its backward, and a hook on its
    inputs' gradients marks the end. Compute is the sum of these windows (a checkpointed block's forward,
    recomputed inside its first backward window, is not counted twice); the rest of forward + backward is
    waiting (reads from the nvme tier, gathers, gradient reduction and writes), and the optimizer step is
    timed on its own."""

    def __init__(self, opt, model):
        import torch

        self.compute = 0.0  # seconds in the current step
        self._enter = None
        self._open = 0  # backward windows open now (a checkpointed block's recomputation runs inside one)
        self._torch = torch
        self._sub = opt.coordinator.subscribe(self)
        self._handles = [m.register_forward_hook(self._after_forward) for m in model.modules()
                         if any(True for _ in m.parameters(recurse=False))]

    # coordinator events
    def module_enter(self, module, index) -> None:
        self._enter = time.perf_counter()

    def module_exit(self, module, index, entry) -> None:
        if self._enter is not None and not self._open:  # a forward recomputed inside a backward window: counted there
            self.compute += time.perf_counter() - self._enter
        self._enter = None

    def __getattr__(self, name):  # the other events: nothing to do
        if name in ("forward_begin", "forward_end", "backward_begin", "backward_visit", "backward_end"):
            return lambda *a: None
        raise AttributeError(name)

    # torch hooks
    def _after_forward(self, module, args, output) -> None:
        torch = self._torch
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not inputs:  # the embeddings of token ids and positions: their backward is a scatter-add, not timed
            return
        box = {}

        def start(grad):
            if "t" not in box:
                self._open += 1
            box["t"] = time.perf_counter()

        def end(grad):
            if "t" in box:
                self._open -= 1
                self.compute += time.perf_counter() - box.pop("t")

        # Plain tensor hooks, held by the tensors alone: under torch.utils.checkpoint a block's first forward
        # keeps nothing for backward and its hooks never fire; they must die with its tensors (a multi-grad
        # hook's state holds its tensors in a cycle, which kept a layer's activations alive per step).
        output.register_hook(start)  # after the coordinator's own hook on it: its gather is done
        inputs[0].register_hook(end)  # every timed module here (Linear, LayerNorm) takes one input

    def take(self) -> float:
        """The compute seconds since the last take(); called once per step."""
        c, self.compute = self.compute, 0.0
        self._open = 0  # a window whose end never fired (no gradient reached the input) closes with the step
        return c

    def close(self) -> None:
        self._sub.remove()
        for h in self._handles:
            h.remove()
