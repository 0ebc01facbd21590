"""The GPT step on an accelerator, every placement side by side inside a hard time budget:
`python -m tierstore.bench.device --out DIR` (bench/device.sh runs it after the build and the accelerator
tests; `make bench-device`, bench/README.md, "Accelerator checks").

Each case (_device_case.CASES) runs in its own process, all built and warmed up at once, then stepped in turn
round after round (A B C ... A B C ...), each step timed from its first kernel to the end of the optimizer step
and its I/O with the accelerator synchronised. After each nvme case's step the raw engine reads and writes at
once the bytes that case moved in its last warm-up step (steps.RawEngine): the disk's time for the step's I/O.
Rounds stop when the next would pass the budget; a step that outlasts its own limit ends its case (killed, the
reason recorded) and the others go on. The JSON is rewritten after every round, so a run cut short still
leaves its figures. --dry-run: a tiny GPT with the CPU standing in for the accelerator, in about a minute.

[Note: bytes per parameter per step]
Two counts of each case's bytes, divided by the model's parameters: /proc/self/io of the case's process
(read_bytes / write_bytes: what reached the block device, whichever library moved it) and the store's own count
(tier_bytes: each tier's bytes in and out, and the optimizer's disk bytes by kind -- params, grads, master,
states). They should agree on the nvme cases; where they differ, something besides the store touched the disk
or the page cache served a read.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ._device_case import CASES
from ._harness import MARK

LABELS = {"torch": "torch AdamW(fused), all in accelerator memory",
          "torch-bf16": "torch AdamW(fused), bf16 autocast",
          "host": "host tier (params on the accelerator; master, states, grads on host)",
          "nvme-overlap": "nvme tier, overlap_step, fp32",
          "nvme-overlap-bf16": "nvme tier, overlap_step, bf16 compute",
          "nvme8-overlap-bf16": "nvme tier, overlap_step, bf16 compute + dynamic8 states",
          "ds-offload": "DeepSpeed ZeRO-3 ZeRO-Offload", "ds-infinity": "DeepSpeed ZeRO-3 ZeRO-Infinity"}
TARGETS = {"host tokens/s vs torch": (">=", 0.8), "nvme step / raw engine": ("<=", 1.1)}
GRACE = 20  # seconds a step or the processes' goodbye may run past the budget (bench/device.sh allows 30)
FIELDS = ("status", "label", "dtype", "median", "tokens_per_s", "vs_torch", "bytes_per_param_per_step",
          "raw_engine_s", "vs_raw_engine", "samples", "peak_rss", "device_memory")  # every case that ran has these


class Worker:
    """One case's process, answered over a pipe line by line; a reader thread feeds a queue, so every wait
    has a real time limit (a silent process cannot block the run)."""

    def __init__(self, case: str, cmd: list[str], env: dict, log_path: str):
        self.case = case
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, cmd: str | None, timeout: float) -> dict:
        """Send `cmd` (None: just wait) and return the answer; RuntimeError when none comes within `timeout`
        seconds or the process ends (it is killed)."""
        if cmd is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError(f"no answer to {cmd or 'start'!r} within {timeout:.0f} s: killed; its stderr ends:\n"
                                   + self.tail()) from None
            if line is None:
                self.kill()
                raise RuntimeError(f"its process ended (exit {self.proc.returncode}); its stderr ends:\n"
                                   + self.tail())
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def machine(dry_run: bool) -> dict:
    """What ran the benchmark: Python, torch, the accelerator (device-generic), CPUs, the native libraries
    and the I/O engine's backend."""
    import platform

    import torch

    from .. import _native
    from ..io import Engine

    out: dict = {"python": platform.python_version(), "torch": torch.__version__,
                 "cuda": getattr(torch.version, "cuda", None), "cpus": os.cpu_count(), "dry_run": dry_run}
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        mod = getattr(torch, acc.type, None)
        idx = torch.accelerator.current_device_index()
        out["accelerator"] = acc.type
        if mod is not None and hasattr(mod, "get_device_properties"):
            props = mod.get_device_properties(idx)
            out["accelerator_name"] = props.name
            out["accelerator_memory"] = int(props.total_memory)
    native = {}
    for lib in ("uring", "crc", "quant"):
        try:
            _native.load(lib)
            native[lib] = "built"
        except ImportError as e:
            native[lib] = f"missing ({e}): the fallback runs"
    out["native"] = native
    eng = Engine()
    out["io_backend"] = eng.backend
    eng.close()
    return out


def deepspeed_problem(python: str, timeout: float, env: dict) -> str | None:
    """Why DeepSpeed cannot run with `python`, or None when it imports and its CPU Adam op loads (builds)
    within `timeout` seconds; the build is cached for the case processes."""
    probe = ("import deepspeed; from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(); "
             "print(deepspeed.__version__)")
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"deepspeed's CPU Adam op did not build within {timeout:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"deepspeed is not importable with its ops by {python} ({last})"
    return None


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(cases: dict[str, dict], raw: dict[str, list[float]], nparams: int, tokens: int) -> list[dict]:
    """Fill each case that ran with its medians, ratios and bytes per parameter per step ([Note: bytes per
    parameter per step]); return the targets, each with its value and whether it was met."""
    for name, c in cases.items():
        ss = c.get("samples") or []
        if not ss:
            continue
        c["median"] = {k: median([s[k] for s in ss]) for k in ("fwd_bwd", "step", "full")}
        c["tokens_per_s"] = tokens / c["median"]["full"]
        proc = {k: median([s["proc_io"][k] for s in ss]) / nparams for k in ss[0].get("proc_io", {})}
        store = {k: median([s["bytes"][k] for s in ss]) / nparams for k in ss[0].get("bytes", {})}
        c["bytes_per_param_per_step"] = {"proc_io": proc, "store": store}
        c["raw_engine_s"] = median(raw[name]) if raw.get(name) else None
        c["vs_raw_engine"] = c["median"]["full"] / c["raw_engine_s"] if c["raw_engine_s"] else None
    ref = cases.get("torch", {}).get("tokens_per_s")
    ref16 = cases.get("torch-bf16", {}).get("tokens_per_s")
    for c in cases.values():
        if "tokens_per_s" in c:
            c["vs_torch"] = c["tokens_per_s"] / ref if ref else None
            c["vs_torch_bf16"] = c["tokens_per_s"] / ref16 if ref16 else None
    targets = []

    def put(what: str, case: str, value) -> None:
        op, bound = TARGETS[what]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets.append({"target": what, "case": case, "value": value, "bound": f"{op} {bound}", "met": met})

    put("host tokens/s vs torch", "host", cases.get("host", {}).get("vs_torch"))
    for name, c in cases.items():
        if CASES[name].get("params") == "nvme":
            put("nvme step / raw engine", name, c.get("vs_raw_engine"))
    return targets


def _f(x, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _x(x, width: int) -> str:
    return ("-" if x is None or x != x else f"{x:.2f}x").rjust(width)


def table(result: dict) -> str:
    """The short text table of a result: one line per case (bytes per parameter per step: /proc/self/io's, and
    the store's for the tier the case uses, then by kind), then the targets."""
    m = result["machine"]
    lines = [f"{m.get('accelerator_name', 'CPU (dry run)' if result['dry_run'] else 'CPU')}, torch {m['torch']}; "
             f"GPT {result['params'] / 1e6:.0f}M params ({result['layers']} x {result['width']}), "
             f"{result['tokens_per_step']} tokens per step, {result['rounds_done']} rounds in "
             f"{result['bench_s']:.0f} s; medians",
             f"{'case':19} {'step s':>7} {'fwd+bwd':>7} {'tokens/s':>9} {'vs torch':>8} {'vs bf16':>7} "
             f"{'vs raw':>6} {'io B/param r|w':>15} {'store B/param r|w':>17}"]
    for name, c in result["cases"].items():
        if c["status"] != "ok":
            lines.append(f"{name:19} {c['status']}: {c.get('reason', '')[:300]}")
            continue
        b = c["bytes_per_param_per_step"]
        io = f"{b['proc_io'].get('nvme_read', 0):.1f} | {b['proc_io'].get('nvme_written', 0):.1f}"
        st = b["store"]
        tier = "nvme" if st.get("nvme_read") or st.get("nvme_written") else "host"
        sto = f"{st.get(f'{tier}_read', 0):.1f} | {st.get(f'{tier}_written', 0):.1f} {tier}" if st else "-"
        med = c["median"]
        lines.append(f"{name:19} {_f(med['full'], '7.3f')} {_f(med['fwd_bwd'], '7.3f')} "
                     f"{_f(c['tokens_per_s'], '9.0f')} {_x(c['vs_torch'], 8)} {_x(c.get('vs_torch_bf16'), 7)} "
                     f"{_x(c['vs_raw_engine'], 6)} {io:>15} {sto:>17}")
        kinds = sorted({k.split("_", 2)[2] for k in st if k.startswith("disk_read_")})
        by = ", ".join(f"{k} {st.get(f'disk_read_{k}', 0):.1f}|{st.get(f'disk_written_{k}', 0):.1f}" for k in kinds
                       if st.get(f"disk_read_{k}") or st.get(f"disk_written_{k}"))
        if by:
            lines.append(f"{'':19} disk B/param by kind, read|written: {by}")
    for t in result["targets"]:
        ok = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"target {t['target']} {t['bound']} ({t['case']}): {_f(t['value'], '.2f')}  {ok}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for device.json and device.txt")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, the CPU standing in for the accelerator")
    ap.add_argument("--params", type=float, default=None, help="GPT parameters (300e6; dry run 2e6)")
    ap.add_argument("--context", type=int, default=None, help="tokens per sequence (1024; dry run 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (8 where the accelerator has "
                    ">= 100 GiB, else 4: all cases' processes hold their activations at once; dry run 2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds at most (5; dry run 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per case before the first round (2; "
                    "dry run 1)")
    ap.add_argument("--budget", type=float, default=300, help="seconds for the whole benchmark, start to end")
    ap.add_argument("--start-timeout", type=float, default=180, help="seconds a case may take to build and warm up")
    ap.add_argument("--step-timeout", type=float, default=60, help="seconds one timed step may take")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--dir", default="bench-data/device", help="directory on the disk under test (nvme files)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per case (all CPUs; dry run 1)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    a.params = a.params or (2e6 if dry else 300e6)
    a.context = a.context or (64 if dry else 1024)
    a.rounds = a.rounds or (2 if dry else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if dry else 2)
    a.threads = a.threads or (1 if dry else os.cpu_count() or 1)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget
    from .. import gpt
    from .steps import RawEngine

    info = machine(a.dry_run)
    if a.batch is None:
        a.batch = 2 if a.dry_run else 8 if info.get("accelerator_memory", 0) >= 100 << 30 else 4
    width, layers = gpt.shape_for(a.params)
    nparams, tokens = gpt.count_params(width, layers, a.context), a.batch * a.context
    out_dir = a.out or os.path.join("bench", "results", f"device-{time.strftime('%Y-%m-%d', time.gmtime())}")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="device-", dir=a.dir)
    names = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad:
        raise SystemExit(f"bench device: unknown case(s) {bad}; choose from {','.join(CASES)}")
    cases: dict[str, dict] = {n: {"status": "pending", "label": LABELS[n], "dtype": CASES[n]["dtype"], "samples": [],
                                  "peak_rss": None, "device_memory": {}}
                              for n in names}
    result: dict = {"command": " ".join(sys.argv), "dry_run": a.dry_run, "machine": info, "params": nparams,
                    "width": width, "layers": layers, "context": a.context, "batch": a.batch,
                    "tokens_per_step": tokens, "budget_s": a.budget, "rounds_done": 0, "bench_s": 0.0,
                    "cases": cases, "raw_engine": {}, "targets": []}
    ds = [n for n in names if CASES[n]["kind"] == "ds"]
    print(f"bench device: {info.get('accelerator_name', 'CPU standing in')}; GPT {nparams / 1e6:.1f}M params "
          f"({layers} x {width}), {tokens} tokens per step; {len(names)} cases, budget {a.budget:.0f} s", flush=True)
    import tierstore

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(tierstore.__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "DS_ACCELERATOR": info.get("accelerator") or "cpu",
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
           "PYTHONPATH": os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    spec = {"params": a.params, "context": a.context, "batch": a.batch, "lr": 1e-4, "warmup": a.warmup,
            "threads": a.threads, "sub_group_bytes": 64 << 20, "dir": root, "dry_run": a.dry_run}
    workers: dict[str, Worker] = {}
    raw: dict[str, list[float]] = {}
    raw_bytes: dict[str, tuple[int, int]] = {}
    engine = None

    def fail(n: str, status: str, why: str) -> None:
        cases[n].update(status=status, reason=why)
        print(f"  {n}: {status} -- {why}", flush=True)
        if n in workers:
            workers.pop(n).kill()

    def save() -> None:
        result["bench_s"] = time.monotonic() - t_start
        result["targets"] = summarize(cases, raw, nparams, tokens)
        with open(os.path.join(out_dir, "device.json"), "w") as f:
            json.dump(result, f, indent=1)

    try:
        def start(n: str) -> None:
            workers[n] = Worker(n, [sys.executable, "-m", "tierstore.bench._device_case",
                                    json.dumps({**spec, "case": n})], env, os.path.join(root, f"{n}.log"))

        for n in names:
            if n not in ds:
                start(n)
        started = min(time.monotonic() + a.start_timeout, deadline - 30)  # all build and warm up at once
        if ds:  # probed while the others build: DeepSpeed's ops may compile for minutes
            why = "dry run: DeepSpeed is left to the accelerator run (its ops compile for minutes)" if a.dry_run else \
                deepspeed_problem(sys.executable, max(1.0, started - time.monotonic()), env)
            for n in ds:
                if why:
                    cases[n].update(status="skipped", reason=why)
                else:
                    start(n)
        for n, w in list(workers.items()):
            try:
                ready = w.ask(None, max(1.0, started - time.monotonic()))
                if "error" in ready:
                    fail(n, "skipped", ready["error"])
                    continue
                cases[n].update(status="ok", ready=ready)
                if CASES[n].get("params") == "nvme":
                    b = ready.get("last", {}).get("bytes", {})
                    raw_bytes[n] = (b.get("nvme_read", 0), b.get("nvme_written", 0))
            except RuntimeError as e:
                fail(n, "failed", f"did not start: {e}")
        if raw_bytes:
            engine = RawEngine(root, max(rd for rd, _ in raw_bytes.values()),
                               max(wr for _, wr in raw_bytes.values()))
        round_s = 0.0
        for r in range(a.rounds):
            if r and time.monotonic() + round_s > deadline:
                print(f"  round {r + 1}: would pass the budget; stopping after {r} rounds", flush=True)
                break
            t0 = time.monotonic()
            for n in list(workers):
                if time.monotonic() > deadline:  # the round stops short; the steps taken so far count
                    print(f"  round {r + 1}: the budget is spent before {n}'s step; stopping", flush=True)
                    break
                try:  # a step may run past the budget by GRACE at most, then its case ends
                    limit = min(a.step_timeout, deadline + GRACE - time.monotonic())
                    cases[n]["samples"].append(workers[n].ask("step", max(1.0, limit)))
                except RuntimeError as e:
                    fail(n, "failed", f"round {r + 1}: {e}")
                    continue
                if engine is not None and n in raw_bytes:
                    raw.setdefault(n, []).append(engine.both(*raw_bytes[n]))
            round_s = time.monotonic() - t0
            if all(len(cases[n]["samples"]) == r + 1 for n in workers):
                result["rounds_done"] = r + 1
            save()
            if time.monotonic() > deadline:
                break
        for n, w in list(workers.items()):
            try:
                cases[n].update(w.ask("done", max(1.0, min(30.0, deadline + GRACE - time.monotonic()))))
            except RuntimeError as e:
                cases[n]["finish_error"] = str(e)
    finally:
        for w in workers.values():
            w.kill()
        logs = []
        for n in names:
            p = os.path.join(root, f"{n}.log")
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    logs.append(f"===== {n}\n{f.read()[-20000:]}")
        with open(os.path.join(out_dir, "workers.log"), "w") as f:
            f.write("\n".join(logs))
        if engine is not None:
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
    for c in cases.values():
        if c["status"] == "ok" and not c["samples"]:
            c.update(status="failed", reason="no timed step within the budget")
    result["raw_engine"] = {n: {"bytes": raw_bytes[n], "s": raw.get(n, [])} for n in raw_bytes}
    save()
    text = table(result)
    with open(os.path.join(out_dir, "device.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
