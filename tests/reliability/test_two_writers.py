"""Two jobs, one checkpoint directory: job A trains and saves after every step; job B, started on the same
directory while A runs, tries to save after every step too; the parent consolidates the directory over and
over meanwhile; A is SIGKILLed at a random moment, then B. The directory has one writer at a time: B is
refused (MisuseError) for as long as A lives and takes the directory over once A died; every consolidate
returns a model one of the jobs saved (checked by its digest against the oracle the job wrote before the
save) and never reports a checkpoint a writer pruned as corrupt; at the end `latest` names the last job's
last save (or the one it was making as it died); the user's own files in the directory are untouched.
See [Note: one writer per checkpoint directory] and [Note: readers and a concurrent cleanup] in
tierstore/zero/checkpoint/directory.py, and docs/reliability.md."""
from __future__ import annotations

import errno
import os
import signal
import time

from tierstore.errors import CorruptionError, TierstoreIOError
from tierstore.zero import consolidate

from . import _children
from ._common import read_json, record, seeds, trial, trials

USER_FILES = {"ckpt-best-model/weights.pt": b"the user's best model", "ckpt-00000000-0000beef/notes.txt": b"mine",
              "README": b"runs of the week"}


def _log(path: str) -> list[tuple[float, str, int]]:
    try:
        with open(path) as f:
            return [(float(t), what, int(step)) for t, what, step in (ln.split() for ln in f if ln.strip())]
    except FileNotFoundError:
        return []


def _read(ckpt: str, oracle: str) -> tuple[str, int] | None:
    """(job, step) of the model consolidate returns; None when a concurrent writer outpaced it every try."""
    try:
        full = consolidate(ckpt)
    except CorruptionError:
        raise  # never: a pruned checkpoint is not damage
    except TierstoreIOError as e:
        if e.errno == errno.ENOENT and "removed while it was read" in str(e):
            return None
        raise
    d = _children.digest(full)
    assert os.path.exists(os.path.join(oracle, d)), "consolidate returned a model no job saved"
    job, step = read_json(os.path.join(oracle, d))
    return job, step


def _start(forkserver, root: str, job: str):
    p = forkserver.Process(target=_children.writer_child, args=(root, job, os.path.join(root, f"log-{job}")))
    p.start()
    return p


def test_two_jobs_one_checkpoint_directory(tmp_path, forkserver):
    campaign = "two writers, one checkpoint directory"
    for seed in seeds(campaign, trials(1, 40)):
        with trial(campaign, seed) as rng:
            root = str(tmp_path / str(seed))
            oracle, ckpt = os.path.join(root, "oracle"), os.path.join(root, "ckpt")
            os.makedirs(oracle)
            for rel, data in USER_FILES.items():
                os.makedirs(os.path.dirname(os.path.join(ckpt, rel)), exist_ok=True)
                with open(os.path.join(ckpt, rel), "wb") as f:
                    f.write(data)
            a = _start(forkserver, root, "A")
            b = None
            try:
                deadline = time.monotonic() + 90
                while not _log(os.path.join(root, "log-A")) and a.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert _log(os.path.join(root, "log-A")), f"job A never saved (exit code {a.exitcode})"
                b = _start(forkserver, root, "B")
                t0 = time.monotonic()
                kill_a = t0 + rng.uniform(0.5, 4.0)
                kill_b = kill_a + rng.uniform(0.5, 4.0)
                killed_a = None  # time.time() just before A's SIGKILL
                reads = 0
                while time.monotonic() < kill_b:
                    if killed_a is None and time.monotonic() >= kill_a:
                        killed_a = time.time()
                        os.kill(a.pid, signal.SIGKILL)
                    got = _read(ckpt, oracle)
                    record(campaign, "(consolidates)")
                    if got is None:
                        record(campaign, "(consolidate outpaced by the writer's cleanup)")
                    reads += 1
                    time.sleep(rng.uniform(0.0, 0.05))
                os.kill(b.pid, signal.SIGKILL)
            finally:
                for p in (a, b):
                    if p is not None:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGKILL)
                        p.join(60)
            for p in (a, b):
                assert p.exitcode == -signal.SIGKILL, "a job died on its own: see its traceback above"
            log_a, log_b = _log(os.path.join(root, "log-A")), _log(os.path.join(root, "log-B"))
            assert all(what == "ok" for _t, what, _s in log_a), "job A, the first writer, was refused"
            b_ok = [(t, s) for t, what, s in log_b if what == "ok"]
            b_refused = [s for _t, what, s in log_b if what == "refused"]
            assert killed_a is not None and all(t > killed_a for t, _s in b_ok), \
                "job B saved while job A, which held the directory, was alive"
            record(campaign, "(saves of B refused while A lived)", len(b_refused))
            job, step = _read(ckpt, oracle) or ("?", -1)
            if b_ok:
                assert job == "B" and step in (b_ok[-1][1], b_ok[-1][1] + 1), (job, step, b_ok[-1])
                record(campaign, "B took the directory over" if step == b_ok[-1][1]
                       else "B took over; its save in progress completed")
            elif job == "B":
                assert step > max(b_refused, default=0), (step, b_refused)
                record(campaign, "B's first save completed as it died")
            else:
                last = log_a[-1][2]
                assert job == "A" and step in (last, last + 1), (job, step, last)
                record(campaign, "B never saved: A's checkpoint stands")
            for rel, data in USER_FILES.items():
                with open(os.path.join(ckpt, rel), "rb") as f:
                    assert f.read() == data, f"the user's {rel} was changed"
