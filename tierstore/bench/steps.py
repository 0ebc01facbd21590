"""What `tierstore bench optim` (a stack of Linear layers) and `tierstore bench train` (a GPT, tokens/s) share:
whole training steps of one model, torch in memory vs each tierstore tier vs DeepSpeed ZeRO-3, each case in its
own process, one step of each per round, in another order each round; the raw engine moving the nvme step's
bytes in the same rounds.

Per case, medians over the rounds: forward + backward, optimizer step, full step (the sum), bytes read from and
written to each tier per step, and the case process's peak RSS (VmHWM: it includes building the model). Per
ratio: its median, the least and the most of its per-round values, and a verdict on its target that the load
cannot flip ([Note: a verdict the load cannot flip] in verdict.py). Bytes per parameter per step, the kernel's
count beside the store's own by kind: bytes_table.py. The
raw engine reads, writes, and reads + writes at once exactly the bytes the nvme case read and wrote in its
last warm-up step (O_DIRECT, page cache dropped, fsync after writing): the disk's time for the step's I/O
(see [Note: ratios, not lone numbers] in _common.py and [Note: one worker process per case] in _harness.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

from ._common import Progress, drop_page_cache, engine_pass, fmt_bytes, print_table, size_arg, write_json
from ._harness import MARK, shape_of
from .bytes_table import per_param, print_bytes_table
from .verdict import Load, round_order, spread_text, verdict

TORCH = ("torch-fused", "torch-foreach")
TIERSTORE = ("host", "nvme", "nvme8", "nvme-bf16", "nvme8-bf16")
DEEPSPEED = ("ds-offload", "ds-infinity", "ds-infinity-bf16")
ALL = TORCH + TIERSTORE + DEEPSPEED
# run only when named in --cases: the nvme tier with one default changed, to measure what the default gives
OPTIONAL = ("nvme-plain", "nvme-overlap", "nvme8-overlap", "nvme-noreuse")
LABELS = {"torch-fused": "torch AdamW(fused), in memory", "torch-foreach": "torch AdamW(foreach), in memory",
          "host": "tierstore host tier", "nvme": "tierstore nvme tier", "nvme8": "tierstore nvme + dynamic8",
          "nvme-bf16": "tierstore nvme, bf16 compute", "nvme8-bf16": "tierstore nvme, bf16 compute + dynamic8",
          "nvme-plain": "tierstore nvme, overlap_step=False (the step after backward)",
          "nvme-overlap": "tierstore nvme, overlap_step=True (overlapped from the first step)",
          "nvme8-overlap": "tierstore nvme + dynamic8, overlap_step=True",
          "nvme-noreuse": "tierstore nvme, reuse_bytes=0 (reads again what is at hand)",
          "ds-offload": "DeepSpeed ZeRO-3 ZeRO-Offload", "ds-infinity": "DeepSpeed ZeRO-3 ZeRO-Infinity",
          "ds-infinity-bf16": "DeepSpeed ZeRO-Infinity, bf16",
          "raw-read": "raw engine: read the nvme step's bytes", "raw-write": "raw engine: write them",
          "raw-both": "raw engine: read + write at once",
          "raw-both-overlap": "raw engine: nvme-overlap's bytes, read + write at once",
          "raw-both-overlap8": "raw engine: nvme8-overlap's bytes, read + write at once"}
DS_VENV = ".venv-ds"
DS_INSTALL = (f"python3 -m venv {DS_VENV} && {DS_VENV}/bin/pip install torch==2.13.0 deepspeed==0.19.8 "
              f"(or: make {DS_VENV})")


def add_arguments(p: argparse.ArgumentParser, model: str) -> None:
    if model == "linear":
        p.add_argument("--params", type=float, default=8e6, help="parameters of the Linear stack (default 8M; e.g. "
                       "33e6, or 134e6 with --width 2048)")
        p.add_argument("--width", type=int, default=1024, help="width of each Linear layer (layers = params/width^2)")
        p.add_argument("--batch", type=int, default=16)
    else:
        p.add_argument("--params", type=float, default=8e6, help="parameters of the GPT (default 8M: 4 layers)")
        p.add_argument("--context", type=int, default=256, help="tokens per sequence")
        p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--cases", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)} (also: "
                   f"{','.join(OPTIONAL)})")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per case, alternated A B A B (3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case before the first round (2)")
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir in .)")
    p.add_argument("--sub-group", type=size_arg, default=64 << 20, help="sub_group_bytes (both tierstore and "
                   "DeepSpeed's sub_group_size)")
    p.add_argument("--pinned", type=size_arg, default=64 << 20, help="tierstore's pinned budget")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per case")
    p.add_argument("--deepspeed-python", default=os.environ.get("TIERSTORE_DS_PYTHON"),
                   help=f"Python of a venv with DeepSpeed (default: $TIERSTORE_DS_PYTHON, else ./{DS_VENV}/bin/python)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw engine's reference")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for any one worker's answer")


class Worker:
    """One case's process: started, then asked for one step at a time (see _harness.serve)."""

    def __init__(self, case: str, cmd: list[str], env: dict, log_path: str):
        self.case = case
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1)
        self.chatter: deque[str] = deque(maxlen=20)  # what the libraries printed on stdout, for errors

    def ask(self, cmd: str | None, timeout: float) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.chatter.append(line.rstrip())
        self.kill()
        raise RuntimeError(f"case {self.case}: its process ended or went silent without an answer to {cmd!r} "
                           f"(exit {self.proc.poll()}); last output:\n" + self.tail())

    def tail(self) -> str:
        if not self._log.closed:  # kill() closes it; what it holds is in the file by then
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            err = f.read()[-3000:]
        return "\n".join(self.chatter) + "\n" + err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def finish(self, timeout: float) -> dict:
        out = self.ask("done", timeout)
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        return out


def deepspeed_python(arg: str | None) -> tuple[str | None, str]:
    """(the DeepSpeed venv's python, or None and why not)."""
    py = arg or os.path.join(DS_VENV, "bin", "python")
    if not os.path.exists(py):
        return None, f"no DeepSpeed venv at {py}; install one with: {DS_INSTALL}"
    r = subprocess.run([py, "-c", "import deepspeed, sys; sys.stdout.write(deepspeed.__version__)"],
                       capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    if r.returncode != 0:
        return None, f"{py} cannot import deepspeed ({r.stderr.strip().splitlines()[-1:]}); install: {DS_INSTALL}"
    return py, f"deepspeed {r.stdout.strip()} ({py})"


def spec_of(args, model: str, root: str) -> dict:
    spec = {"model": model, "params": args.params, "batch": args.batch, "lr": 1e-3, "warmup": args.warmup,
            "threads": args.threads, "sub_group_bytes": args.sub_group, "pinned_bytes": args.pinned, "dir": root}
    if model == "linear":
        spec["width"] = args.width
    else:
        spec["context"] = args.context
    return spec


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class RawEngine:
    """The raw engine reading, writing, and reading + writing at once `nread` / `nwrite` bytes in 1 MiB
    requests, all in flight (buffers reused round-robin: the figure is the disk's, not memory's)."""

    REQ = 1 << 20  # bytes per request

    def __init__(self, root: str, nread: int, nwrite: int):
        from ..io import Engine
        from ..tiers.host import aligned_empty

        self.eng = Engine()
        self.nread = -(-max(nread, 1) // self.REQ)  # requests
        self.nwrite = -(-max(nwrite, 1) // self.REQ)
        self.bufs = [aligned_empty(self.REQ) for _ in range(32)]
        for b in self.bufs:
            b.fill_(1)
        self.rfile, self.wfile = os.path.join(root, "raw-read.bin"), os.path.join(root, "raw-write.bin")
        engine_pass(self.eng, self.rfile, "w", self._pieces(self.nread))  # the file the reads read

    def _pieces(self, n: int):
        return [(self.bufs[i % len(self.bufs)], i * self.REQ) for i in range(n)]

    def read(self) -> float:
        return engine_pass(self.eng, self.rfile, "r", self._pieces(self.nread))

    def write(self) -> float:
        return engine_pass(self.eng, self.wfile, "w", self._pieces(self.nwrite))

    def both(self, nread: int | None = None, nwrite: int | None = None) -> float:
        """Read and write at once: the step's bytes, or `nread` / `nwrite` bytes (the read file holds the most
        any case moves)."""
        nr = self.nread if nread is None else -(-max(nread, 1) // self.REQ)  # requests
        nw = self.nwrite if nwrite is None else -(-max(nwrite, 1) // self.REQ)
        drop_page_cache([self.rfile])
        fr, fw = self.eng.open(self.rfile, "r"), self.eng.open(self.wfile, "w")
        t0 = time.perf_counter()
        for i in range(max(nr, nw)):
            if i < nr:
                self.eng.read(fr, self.bufs[i % len(self.bufs)], i * self.REQ)
            if i < nw:
                self.eng.write(fw, self.bufs[(i + 16) % len(self.bufs)], i * self.REQ)
        self.eng.wait_all()
        self.eng.fsync(fw)
        dt = time.perf_counter() - t0
        self.eng.close_file(fr)
        self.eng.close_file(fw)
        return dt

    def close(self) -> None:
        self.eng.close()


def run(args, model: str, name: str) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in ALL + OPTIONAL]
    if bad or not cases:
        raise SystemExit(f"bench {name}: unknown case(s) {bad}; choose from {','.join(ALL + OPTIONAL)}")
    load0 = os.getloadavg()
    load = Load(samples=[load0[0]])
    orders: list[list[str]] = []  # each round's order of the cases
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.dir or ".")
    spec = spec_of(args, model, root)
    width, layers, nparams = shape_of(spec)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    ds_py = None
    if any(c in DEEPSPEED for c in cases):
        ds_py, why = deepspeed_python(args.deepspeed_python)
        notes.append(f"DeepSpeed: {why}")
        if ds_py is None:
            for c in DEEPSPEED:
                if c in cases:
                    skipped[c] = why
    import tierstore

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(tierstore.__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    starting: dict[str, Worker] = {}
    workers: dict[str, Worker] = {}  # the started ones that answered ready
    ready: dict[str, dict] = {}
    raw = None
    try:
        print(f"bench {name}: {nparams / 1e6:.1f}M parameters ({layers} x {width}), load average "
              f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; starting {len(cases)} case processes ...", flush=True)
        for c in cases:  # all at once: they build their models and warm up side by side, nothing is timed yet
            if c in skipped:
                continue
            cspec = json.dumps({**spec, "case": c})
            if c in DEEPSPEED:
                cmd = [ds_py or "", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ds_case.py"), cspec]
            else:
                cmd = [sys.executable, "-m", "tierstore.bench._case", cspec]
            starting[c] = Worker(c, cmd, env, os.path.join(root, f"{c}.log"))
        for c, w in starting.items():
            try:
                r = w.ask(None, args.timeout)
            except RuntimeError as e:
                skipped[c] = f"failed to start: {str(e)[-1500:]}"
                continue
            if "error" in r:
                w.kill()
                skipped[c] = r["error"]
                continue
            workers[c], ready[c] = w, r
        for c, why in skipped.items():
            print(f"  {c}: skipped -- {why}", flush=True)
        raw_cases: dict[str, object] = {}
        nvme_bytes = ready.get("nvme", {}).get("last", {}).get("bytes", {})
        # the overlapped step moves fewer bytes (no gradient partition touches the disk): its own reference
        ov_bytes = ready.get("nvme-overlap", {}).get("last", {}).get("bytes", {})
        # and with 8-bit states: the disk's own speedup for the dynamic8 target, next to the one measured
        ov8_bytes = ready.get("nvme8-overlap", {}).get("last", {}).get("bytes", {})
        if not args.no_raw and (nvme_bytes or ov_bytes or ov8_bytes):
            most = [max(b.get(k, 0) for b in (nvme_bytes, ov_bytes, ov8_bytes)) for k in ("nvme_read", "nvme_written")]
            raw = RawEngine(root, most[0], most[1])
            if nvme_bytes:
                raw_cases = {"raw-read": raw.read, "raw-write": raw.write, "raw-both": raw.both}
            for c, b in (("raw-both-overlap", ov_bytes), ("raw-both-overlap8", ov8_bytes)):
                if b:
                    raw_cases[c] = functools.partial(raw.both, b.get("nvme_read", 0), b.get("nvme_written", 0))
        samples: dict[str, list[dict]] = {c: [] for c in [*workers, *raw_cases]}
        with Progress(args.rounds * len(samples), f"bench {name}") as prog:
            for k in range(args.rounds):  # [Note: a verdict the load cannot flip] in verdict.py
                order = round_order(list(samples), k)
                orders.append(order)
                for c in order:
                    load.sample()
                    if c in workers:
                        samples[c].append(workers[c].ask("step", args.timeout))
                    else:
                        samples[c].append({"full": raw_cases[c]()})  # type: ignore[operator]
                    prog.advance()
        load.sample()
        final = {c: w.finish(args.timeout) for c, w in workers.items()}
    except BaseException:
        for w in workers.values():
            print(f"--- {w.case} output ---\n{w.tail()}", file=sys.stderr)
        raise
    finally:
        for w in starting.values():
            w.kill()
        if raw is not None:
            raw.close()
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()
    load.samples.append(load1[0])
    tokens = args.batch * args.context if model == "gpt" else 0
    result = summarize(samples, final, ready, tokens, nparams)
    result["verdicts"] = verdicts(result, load)
    print_results(name, result, args, nparams, layers, width, tokens, load, skipped, notes)
    write_json(getattr(args, "json", None), {
        "command": " ".join(sys.argv), "benchmark": name, "model": model, "parameters": nparams, "layers": layers,
        "width": width, "tokens_per_step": tokens, "rounds": args.rounds, "load_average": [load0, load1],
        "load": load.as_dict(), "round_orders": orders, "median": result["median"], "ratios": result["ratios"],
        "ratio_rounds": result["ratio_rounds"], "verdicts": result["verdicts"], "targets": TARGETS,
        "byte_rounds": result["byte_rounds"], "byte_targets": BYTE_TARGETS,
        "byte_verdicts": byte_verdicts(result["byte_rounds"]),
        "peak_rss": result["peak_rss"], "bytes_per_step": result["bytes"],
        "bytes_per_param_per_step": per_param(result["bytes"], nparams), "samples": samples, "ready": ready,
        "skipped": skipped, "notes": notes})
    plot(name, args, result, nparams)
    return 0


def summarize(samples: dict[str, list[dict]], final: dict[str, dict], ready: dict[str, dict], tokens: int,
              nparams: int = 0) -> dict:
    """Medians per case, the ratios the targets are stated in, peak RSS, bytes per step and, with `nparams`, the
    kernel's bytes per parameter per step against BYTE_TARGETS."""
    med = {c: {k: _median([s[k] for s in ss if k in s]) for k in ("fwd_bwd", "step", "full")}
           for c, ss in samples.items()}
    by = {}
    for c, ss in samples.items():
        if ss and "bytes" in ss[0]:
            keys = ss[0]["bytes"].keys()
            by[c] = {k: int(_median([s["bytes"][k] for s in ss])) for k in keys}
    rss = {c: f["peak_rss"] for c, f in final.items()}
    ratios: dict[str, float] = {}
    per_round: dict[str, list[float]] = {}  # each round's ratio, from that round's A and B

    def rounds_of(c: str, what: str = "full") -> list[float]:
        return [s.get(what, float("nan")) for s in samples.get(c, [])]

    def each(f, *series: list[float]) -> list[float]:
        return [f(*vs) if all(v > 0 for v in vs) else float("nan") for vs in zip(*series)]

    def put(key: str, a: str, b: str, what: str = "full") -> None:
        if a in med and b in med and med[b][what] > 0:
            ratios[key] = med[a][what] / med[b][what]
            per_round[key] = each(lambda x, y: x / y, rounds_of(a, what), rounds_of(b, what))

    for c in TIERSTORE + OPTIONAL + DEEPSPEED + ("torch-foreach",):
        put(f"{c}/torch-fused full", c, "torch-fused")
    put("nvme speedup over nvme-plain, full", "nvme-plain", "nvme")
    put("nvme8 speedup over nvme, full", "nvme", "nvme8")
    put("nvme-overlap speedup over nvme, full", "nvme", "nvme-overlap")
    put("nvme8-overlap speedup over nvme-overlap, full", "nvme-overlap", "nvme8-overlap")
    put("raw engine: nvme-overlap's bytes over nvme8-overlap's", "raw-both-overlap", "raw-both-overlap8")
    put("nvme8-overlap full / raw read+write of its bytes at once", "nvme8-overlap", "raw-both-overlap8")
    put("nvme speedup over nvme-noreuse (reuse_bytes), full", "nvme-noreuse", "nvme")
    for c, raw in (("nvme", "raw-both"), ("nvme-overlap", "raw-both-overlap")):  # the raw engine moves c's bytes
        if c in med and "torch-fused" in med and raw in med:
            key = f"{c} full / max(torch-fused full, raw read+write at once)"
            ratios[key] = med[c]["full"] / max(med["torch-fused"]["full"], med[raw]["full"])
            per_round[key] = each(lambda x, t, r: x / max(t, r), rounds_of(c), rounds_of("torch-fused"),
                                  rounds_of(raw))
    for ours, theirs in (("host", "ds-offload"), ("nvme", "ds-infinity"), ("nvme8", "ds-infinity"),
                         ("nvme-overlap", "ds-infinity"), ("nvme-bf16", "ds-infinity-bf16"),
                         ("nvme8-bf16", "ds-infinity-bf16")):
        for what in ("fwd_bwd", "step", "full"):
            put(f"{ours}/{theirs} {what}", ours, theirs, what)
        if ours in rss and theirs in rss:
            ratios[f"{ours}/{theirs} peak RSS"] = rss[ours] / rss[theirs]
            per_round[f"{ours}/{theirs} peak RSS"] = [rss[ours] / rss[theirs]]  # one value: not timed
    tps = {c: tokens / m["full"] for c, m in med.items() if tokens and c in ready} if tokens else {}
    if tps and "torch-fused" in tps:
        for c in tps:
            if c != "torch-fused":
                ratios[f"{c}/torch-fused tokens/s"] = tps[c] / tps["torch-fused"]
                per_round[f"{c}/torch-fused tokens/s"] = each(lambda t, x: t / x, rounds_of("torch-fused"),
                                                              rounds_of(c))
    return {"median": med, "ratios": ratios, "ratio_rounds": per_round, "peak_rss": rss, "bytes": by,
            "tokens_per_s": tps, "byte_rounds": byte_rounds(samples, nparams) if nparams else {}}


# the kernel's bytes read + written per parameter per step: at most this, and at most the DeepSpeed case of the
# same precision in the same run (its bytes in the same rounds)
BYTE_TARGETS = {"nvme": (27.0, "ds-infinity"), "nvme-bf16": (26.0, "ds-infinity-bf16"),
                "nvme8-bf16": (14.0, "ds-infinity-bf16")}


def byte_rounds(samples: dict[str, list[dict]], nparams: int) -> dict[str, list[float]]:
    """Each case's kernel bytes read + written per parameter, one value per timed step."""
    out = {}
    for c, ss in samples.items():
        vals = [(s["bytes"]["kernel_read"] + s["bytes"]["kernel_written"]) / nparams for s in ss
                if "kernel_read" in s.get("bytes", {})]
        if vals:
            out[c] = vals
    return out


def byte_verdicts(rounds: dict[str, list[float]]) -> list[list[str]]:
    """Rows (check, value, target, verdict) of BYTE_TARGETS for the cases that ran: bytes are not timed, so
    the load cannot flip them; every step's count must be on the target's side."""
    rows = []
    for c, (most, peer) in BYTE_TARGETS.items():
        if c not in rounds:
            continue
        mine = rounds[c]
        rows.append([f"{c}: B/param/step", f"{statistics.median(mine):.2f}", f"<= {most:g}",
                     verdict(mine, ("<=", most), None, timed=False)])
        if peer in rounds:
            theirs = statistics.median(rounds[peer])
            rows.append([f"{c} / {peer} bytes", f"{statistics.median(mine) / theirs:.2f}x", "<= 1x",
                         verdict([m / theirs for m in mine], ("<=", 1.0), None, timed=False)])
    return rows


def verdicts(result: dict, load: Load) -> dict[str, str]:
    """The verdict on each ratio that has a target (verdict.verdict): peak RSS from its one value, the timed
    ratios from their rounds and the load."""
    return {k: verdict(result["ratio_rounds"].get(k, [v]), TARGETS[k], load, timed=not k.endswith("peak RSS"))
            for k, v in result["ratios"].items() if k in TARGETS}


TARGETS = {  # the targets printed next to the ratios: (comparison, bound)
    "host/torch-fused full": ("<=", 1.1), "nvme full / max(torch-fused full, raw read+write at once)": ("<=", 1.15),
    "nvme-overlap full / max(torch-fused full, raw read+write at once)": ("<=", 1.15),
    "nvme8 speedup over nvme, full": (">=", 1.5), "nvme8-overlap speedup over nvme-overlap, full": (">=", 1.5),
    "host/ds-offload full": ("<=", 0.7), "nvme-overlap/ds-infinity full": ("<=", 0.7),
    "nvme/ds-infinity full": ("<=", 0.7), "host/ds-offload peak RSS": ("<=", 0.5),
    "nvme/ds-infinity peak RSS": ("<=", 0.5), "host/torch-fused tokens/s": (">=", 0.95),
    "nvme/torch-fused tokens/s": (">=", 0.85), "nvme8/torch-fused tokens/s": (">=", 0.85),
    "nvme-overlap/torch-fused tokens/s": (">=", 0.85), "nvme8-overlap/torch-fused tokens/s": (">=", 0.85),
}


def print_results(name, result, args, nparams, layers, width, tokens, load: Load, skipped, notes) -> None:
    med, rss, by, tps = result["median"], result["peak_rss"], result["bytes"], result["tokens_per_s"]
    cols = ["case", "fwd+bwd ms", "step ms", "full ms", "full vs torch", *(["tokens/s"] if tokens else []),
            "host read/written", "nvme read/written", "peak RSS"]
    ref = med.get("torch-fused", {}).get("full")
    rows = []
    for c, m in med.items():
        if c.startswith("raw-"):
            continue
        b = by.get(c, {})
        rows.append([LABELS[c], f"{m['fwd_bwd'] * 1e3:.1f}", f"{m['step'] * 1e3:.1f}", f"{m['full'] * 1e3:.1f}",
                     f"{m['full'] / ref:.2f}x" if ref else "-", *([f"{tps[c]:,.0f}"] if tokens else []),
                     f"{fmt_bytes(b['host_read'])} / {fmt_bytes(b['host_written'])}" if "host_read" in b else "-",
                     f"{fmt_bytes(b['nvme_read'])} / {fmt_bytes(b['nvme_written'])}" if "nvme_read" in b else "-",
                     fmt_bytes(rss[c]) if c in rss else "-"])
    nb, ob, ob8 = by.get("nvme", {}), by.get("nvme-overlap", {}), by.get("nvme8-overlap", {})
    for c in ("raw-read", "raw-write", "raw-both", "raw-both-overlap", "raw-both-overlap8"):
        if c in med:
            moved = {"raw-read": nb.get("nvme_read", 0), "raw-write": nb.get("nvme_written", 0),
                     "raw-both": nb.get("nvme_read", 0) + nb.get("nvme_written", 0),
                     "raw-both-overlap": ob.get("nvme_read", 0) + ob.get("nvme_written", 0),
                     "raw-both-overlap8": ob8.get("nvme_read", 0) + ob8.get("nvme_written", 0)}[c]
            rows.append([LABELS[c], "", "", f"{med[c]['full'] * 1e3:.1f}",
                         f"{moved / med[c]['full'] / 2**30:.2f} GiB/s", *([""] if tokens else []), "", "", ""])
    print_table(f"bench {name}: {nparams / 1e6:.1f}M fp32 parameters ({layers} x {width})"
                + (f", {tokens} tokens per step" if tokens else "")
                + f", medians of {args.rounds} rounds, the order changed each round", cols, rows,
                caption="bytes: the median per step (store.stats; DeepSpeed: /proc/self/io), peak RSS: VmHWM of the "
                        "case's own process; every round's figures: the JSON's samples")
    rrows = []
    for k, v in result["ratios"].items():
        t = TARGETS.get(k)
        rrows.append([k, f"{v:.2f}x", spread_text(result["ratio_rounds"].get(k, [])), f"{t[0]} {t[1]}x" if t else "",
                      result["verdicts"].get(k, "")])
    print_table(f"bench {name}: ratios (same run)", ["ratio", "median", "rounds min–max", "target", "verdict"],
                rrows, caption=f"{load.describe()} ([Note: a verdict the load cannot flip] in bench/verdict.py)")
    print_bytes_table(f"bench {name}", by, nparams, LABELS)
    brows = byte_verdicts(result.get("byte_rounds", {}))
    if brows:
        print_table(f"bench {name}: bytes per parameter per step against their targets (the kernel's count)",
                    ["check", "median", "target", "verdict"], brows,
                    caption="every timed step's count must be on the target's side; bytes do not follow the load")
    for c, why in skipped.items():
        print(f"skipped {c}: {why}")
    for n in notes:
        print(n)


def plot(name: str, args, result: dict, nparams: int) -> None:
    from ..plot import Panel, Series, png_path, save_png

    med = {c: m for c, m in result["median"].items() if not c.startswith("raw-")}
    names = list(med)
    panels = [Panel(f"one training step, median of {args.rounds} rounds", "ms", [
        Series("forward + backward", names, [med[c]["fwd_bwd"] * 1e3 for c in names], "o"),
        Series("optimizer step", names, [med[c]["step"] * 1e3 for c in names], "s"),
        Series("full step", names, [med[c]["full"] * 1e3 for c in names], "^")],
        hlines=[(result["median"]["raw-both"]["full"] * 1e3, "raw engine: the nvme step's bytes, read + write")]
        if "raw-both" in result["median"] else []),
        Panel("peak RSS of each case's process", "MiB", [
            Series("peak RSS", list(result["peak_rss"]), [v / 2**20 for v in result["peak_rss"].values()], "o")])]
    text = save_png(png_path(getattr(args, "json", None), None),
                    f"tierstore bench {name}: {nparams / 1e6:.0f}M fp32 parameters", panels)
    if text:
        print(text)
