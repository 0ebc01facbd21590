"""A checkpoint directory as save_checkpoint owns it (zero/checkpoint/directory.py): nothing it did not write is
followed, written or removed ([Note: what save_checkpoint removes]); keep and client_state are checked before
anything is created; one writer at a time ([Note: one writer per checkpoint directory]); readers and a
concurrent cleanup ([Note: readers and a concurrent cleanup]); latest and meta.json are read only as regular
files of bounded size."""
from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.dist import context, run_ranks
from tests.support.models import batches, loss_fn, make_pair
from tests.support.zero import cfg
from tierstore.errors import CorruptionError, MisuseError, TierstoreIOError, TierstoreValueError
from tierstore.zero import Zero3Optimizer, consolidate
from tierstore.zero.checkpoint.directory import LOCK, MARK
from tierstore.zero.checkpoint.records import RecordFile


def trained(tmp_path, name="a", steps=1):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / name))
    train(m, opt, steps)
    return m, opt


def train(m, opt, steps=1, seed=0):
    for x, y in batches(steps, seed=seed):
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


def ckpts(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("ckpt-"))


def tree(d) -> dict[str, bytes | str]:
    """Every entry under d: a file's bytes, a symlink's target."""
    out: dict[str, bytes | str] = {}
    for top, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(top, n)
            if os.path.islink(p):
                out[os.path.relpath(p, d)] = os.readlink(p)
            elif os.path.isfile(p):
                out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


# -- nothing outside tierstore's own files is followed or written ------------------------------------------

@pytest.mark.parametrize("planted", ["latest.tmp", "latest", LOCK])
def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path, planted):
    _m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    target = tmp_path / "bashrc"
    target.write_bytes(b"keep me!!")
    os.symlink(target, ck / planted)
    with pytest.raises(TierstoreIOError, match="symlink") as e:
        opt.save_checkpoint(ck)
    assert e.value.filename == str(ck / planted)
    assert target.read_bytes() == b"keep me!!"
    assert ckpts(ck) == []  # refused before the new checkpoint was made
    opt.close()


def test_a_symlinked_checkpoint_directory_is_neither_written_through_nor_removed(tmp_path):
    _m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    opt.save_checkpoint(tmp_path / "elsewhere")  # a real tierstore checkpoint, outside ck
    outside = tmp_path / "elsewhere" / ckpts(tmp_path / "elsewhere")[0]
    before = tree(outside)
    ck.mkdir()
    os.symlink(outside, ck / "ckpt-00000000-00000000")  # matches tierstore's names; older than any save
    for _ in range(2):
        train(_m, opt)
        opt.save_checkpoint(ck, keep=0)
    assert os.path.islink(ck / "ckpt-00000000-00000000") and tree(outside) == before
    opt.close()


def test_only_tierstores_own_checkpoint_directories_are_removed(tmp_path):
    m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    mine = {"ckpt-best-model/weights.pt": b"w", "ckpt-00000000-abcdef/notes.txt": b"n", "ckpt-7/x": b"x",
            "ckpt-00000001-beef/meta.json": b'{"format": "mine"}', "notes/ckpt-00000002-aa/y": b"y"}
    for rel, data in mine.items():
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_bytes(data)
    (ck / "ckpt-00000003-cafe").mkdir()  # empty: a save that died right after its mkdir
    (ck / "ckpt-00000004-f00d").mkdir()  # a save that died after its mark
    (ck / "ckpt-00000004-f00d" / MARK).write_text('{"format": "tierstore.zero.checkpoint.dir"}')
    (ck / "ckpt-00000004-f00d" / "rank00000.bin.tmp").write_bytes(b"partial")
    for _ in range(3):
        train(m, opt)
        opt.save_checkpoint(ck, keep=0)
    assert {k: v for k, v in tree(ck).items() if k in mine} == mine  # the user's files, all there
    left = ckpts(ck)
    assert "ckpt-00000003-cafe" not in left and "ckpt-00000004-f00d" not in left
    ours = [n for n in left if os.path.exists(ck / n / MARK)]
    assert len(ours) == 1 and open(ck / "latest").read() == ours[0]
    opt.close()


@pytest.mark.parametrize("keep", [-1, -2, True, 1.5, "1"])
def test_a_bad_keep_is_refused_before_anything_is_written(tmp_path, keep):
    _m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    first = opt.save_checkpoint(ck)
    before = tree(ck)
    with pytest.raises(TierstoreValueError, match="keep"):
        opt.save_checkpoint(ck, keep=keep)
    assert tree(ck) == before and os.path.isdir(first)
    opt.close()


def test_keep_none_keeps_every_checkpoint_and_keep_counts_previous_ones(tmp_path):
    m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    for _ in range(3):
        train(m, opt)
        opt.save_checkpoint(ck, keep=None)
    assert len(ckpts(ck)) == 3
    for n in ckpts(ck):
        os.unlink(ck / n / MARK)  # as an older tierstore wrote them: known by their meta.json
    opt.save_checkpoint(ck, keep=1)
    assert len(ckpts(ck)) == 2
    opt.save_checkpoint(ck, keep=0)
    assert len(ckpts(ck)) == 1
    opt.close()


def test_an_invalid_client_state_creates_nothing(tmp_path):
    _m, opt = trained(tmp_path)
    with pytest.raises(TierstoreValueError, match="client_state"):
        opt.save_checkpoint(tmp_path / "new", client_state={"x": object()})
    assert not (tmp_path / "new").exists()
    ck = tmp_path / "ck"
    opt.save_checkpoint(ck)
    before = tree(ck)
    with pytest.raises(TierstoreValueError, match="client_state"):
        opt.save_checkpoint(ck, client_state=[1, {2, 3}])
    assert tree(ck) == before
    opt.close()


# -- latest and meta.json: regular files of bounded size ----------------------------------------------------

def _fifo_reader_timed(path: str) -> float:
    """Seconds consolidate takes with a FIFO at `path`; a thread opens its other end after 3 s, so a reader
    that blocks on it is let go (and seen to have waited)."""
    os.mkfifo(path)

    def unblock():
        time.sleep(3)
        try:
            fd = os.open(path, os.O_RDWR)  # never blocks, and lets a blocked reader's open return
            os.close(fd)
        except OSError:
            pass
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(CorruptionError):
        consolidate(os.path.dirname(path) if path.endswith("latest") else os.path.dirname(os.path.dirname(path)))
    took = time.monotonic() - t0
    t.join()
    return took


@pytest.mark.parametrize("which", ["latest", "meta.json"])
def test_a_fifo_as_latest_or_meta_is_refused_at_once(tmp_path, which):
    _m, opt = trained(tmp_path)
    sub = opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    path = str(tmp_path / "ck" / "latest") if which == "latest" else os.path.join(sub, "meta.json")
    os.unlink(path)
    assert _fifo_reader_timed(path) < 2


@pytest.mark.parametrize("which", ["latest", "meta.json"])
def test_a_symlink_to_dev_zero_or_a_huge_file_is_refused_before_it_is_read(tmp_path, which):
    _m, opt = trained(tmp_path)
    sub = opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    path = str(tmp_path / "ck" / "latest") if which == "latest" else os.path.join(sub, "meta.json")
    os.unlink(path)
    os.symlink("/dev/zero", path)
    with pytest.raises(CorruptionError, match="symlink"):
        consolidate(tmp_path / "ck")
    os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB of zeros
    with pytest.raises(CorruptionError, match="more than such a file can need"):
        consolidate(tmp_path / "ck")


# -- one writer per directory -------------------------------------------------------------------------------

def _holder(root: str, ready: str) -> None:
    """Another job: saves into root/ck, says so, and keeps running."""
    torch.set_num_threads(1)
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(Path(root) / "holder"))
    train(m, opt)
    opt.save_checkpoint(os.path.join(root, "ck"))
    Path(ready).write_text("saved")
    time.sleep(120)


def _start_holder(tmp_path):
    p = context().Process(target=_holder, args=(str(tmp_path), str(tmp_path / "ready")), daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists() and p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / "ready").exists(), f"the holder did not save (exit code {p.exitcode})"
    return p


def test_a_second_job_is_refused_naming_the_holder_and_takes_over_once_it_died(tmp_path):
    p = _start_holder(tmp_path)
    try:
        m, opt = trained(tmp_path, "b", steps=2)
        ck = tmp_path / "ck"
        before = tree(ck)
        with pytest.raises(MisuseError) as e:
            opt.save_checkpoint(ck)
        msg = str(e.value)
        assert str(ck) in msg and f"pid {p.pid}" in msg and socket.gethostname() in msg
        assert tree(ck) == before  # refused up front: nothing written, nothing removed
        with pytest.raises(MisuseError):
            opt.save_checkpoint(ck)  # still refused at the next save: not only during the holder's saves
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    sub = opt.save_checkpoint(ck)  # the holder died: its lock went with it
    assert open(ck / "latest").read() == os.path.basename(sub)
    full = consolidate(ck)
    assert all(torch.equal(full[k], v) for k, v in opt.full_state_dict().items())
    opt.close()


def test_two_optimizers_of_one_process_are_two_writers(tmp_path):
    _m, a = trained(tmp_path, "a")
    _m2, b = trained(tmp_path, "b")
    a.save_checkpoint(tmp_path / "ck")
    with pytest.raises(MisuseError, match="close that optimizer first"):
        b.save_checkpoint(tmp_path / "ck")
    a.save_checkpoint(tmp_path / "ck")  # the holder goes on
    a.close()
    b.save_checkpoint(tmp_path / "ck")  # the first one closed: the directory passes on
    b.close()


def test_a_removed_lock_file_is_taken_anew_and_whoever_holds_it_writes(tmp_path):
    _m, opt = trained(tmp_path, "b")
    ck = tmp_path / "ck"
    opt.save_checkpoint(ck)
    os.unlink(ck / LOCK)  # by hand, or with the whole directory
    opt.save_checkpoint(ck)  # nobody else took it: this job locks the new file and goes on
    os.unlink(ck / LOCK)
    p = _start_holder(tmp_path)  # another job takes the directory meanwhile
    try:
        with pytest.raises(MisuseError, match=f"pid {p.pid}"):
            opt.save_checkpoint(ck)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    opt.close()


def test_an_optimizer_saving_into_new_directories_holds_a_bounded_number(tmp_path):
    from tierstore.zero.checkpoint import directory as ckpt_dir
    _m, opt = trained(tmp_path)
    for k in range(ckpt_dir.HOLD_MAX + 3):
        opt.save_checkpoint(tmp_path / f"checkpoint-{k}" / "optimizer", keep=0)
    assert len(ckpt_dir.held(opt)) == ckpt_dir.HOLD_MAX
    import shutil
    shutil.rmtree(tmp_path / "checkpoint-9")  # a Trainer's rotation: that one is let go at the next save
    opt.save_checkpoint(tmp_path / "checkpoint-20" / "optimizer", keep=0)
    dirs = sorted(os.path.basename(os.path.dirname(d)) for d in ckpt_dir.held(opt))
    assert "checkpoint-9" not in dirs and "checkpoint-20" in dirs and "checkpoint-10" in dirs
    opt.close()
    assert not ckpt_dir.held(opt)


def _ranks_refused(rank, world, root):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(Path(root) / f"r{rank}"))
    train(m, opt)
    try:
        opt.save_checkpoint(os.path.join(root, "ck"))
        out = None
    except MisuseError as e:
        out = str(e)
    opt.close()
    return out


def test_every_rank_of_a_second_job_is_refused(tmp_path):
    _m, opt = trained(tmp_path)
    opt.save_checkpoint(tmp_path / "ck")
    before = tree(tmp_path / "ck")
    got = run_ranks(_ranks_refused, 2, str(tmp_path))
    assert all(g is not None and f"pid {os.getpid()}" in g for g in got), got
    assert tree(tmp_path / "ck") == before
    opt.close()


# -- readers and a concurrent cleanup -----------------------------------------------------------------------

def test_consolidate_retries_when_a_writer_pruned_the_checkpoint_it_was_reading(tmp_path, monkeypatch):
    m, opt = trained(tmp_path)
    ck = tmp_path / "ck"
    old = opt.save_checkpoint(ck)
    train(m, opt)
    new = opt.save_checkpoint(ck, keep=1)
    want = opt.full_state_dict()
    (ck / "latest").write_text(os.path.basename(old))  # a reader starts on the old one ...
    real = RecordFile.__init__  # the race is staged when the reader opens its first file: no public hook there
    raced = []

    def open_record(self, path, *a, **kw):
        if not raced and path.startswith(old):  # ... and a save moves `latest` on and prunes it meanwhile
            raced.append(path)
            (ck / "latest").write_text(os.path.basename(new))
            import shutil
            shutil.rmtree(old)
        return real(self, path, *a, **kw)
    monkeypatch.setattr(RecordFile, "__init__", open_record)
    full = consolidate(ck)
    assert raced and all(torch.equal(full[k], v) for k, v in want.items())
    opt.close()


def test_a_checkpoint_damaged_in_place_is_still_corruption(tmp_path):
    _m, opt = trained(tmp_path)
    sub = opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    os.unlink(os.path.join(sub, "rank00000.bin"))  # `latest` still names it: not a concurrent cleanup
    with pytest.raises(CorruptionError, match="missing") as e:
        consolidate(tmp_path / "ck")
    assert e.value.errno == errno.EBADMSG


def test_without_flock_the_owner_record_decides(tmp_path, monkeypatch):
    """A filesystem that refuses flock (Lustre without -o flock): a record naming a live process refuses the
    save; one naming a process that is gone is taken over."""
    import fcntl
    import json
    import subprocess

    from tierstore.zero.checkpoint import directory as ckpt_dir

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    _m, opt = trained(tmp_path)  # its store locks its own directory first
    monkeypatch.setattr(fcntl, "flock", no_flock)
    ck = tmp_path / "ck"
    ck.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        rec = {"host": socket.gethostname(), "pid": other.pid, "start": ckpt_dir.start_time(other.pid), "run": "x",
               "since": "then"}
        (ck / LOCK).write_text(json.dumps(rec))
        with pytest.raises(MisuseError, match=f"pid {other.pid}.*no flock"):
            opt.save_checkpoint(ck)
        assert ckpts(ck) == []
    finally:
        other.kill()
        other.wait()
    opt.save_checkpoint(ck)  # that process is gone: the directory is taken over
    assert json.loads((ck / LOCK).read_text())["pid"] == os.getpid()
    opt.close()


def _rank1_bad_client_state(rank, world, root):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(Path(root) / f"r{rank}"))
    train(m, opt)
    try:
        opt.save_checkpoint(os.path.join(root, "ck"), client_state={"fine": 1} if rank == 0 else {"x": object()})
        out = None
    except TierstoreValueError as e:
        out = str(e)
    opt.close()
    return out


def test_a_bad_client_state_on_one_rank_refuses_the_save_on_every_rank_before_anything_is_made(tmp_path):
    got = run_ranks(_rank1_bad_client_state, 2, str(tmp_path))
    assert "rank 1" in got[0] and "client_state" in got[1], got
    assert not (tmp_path / "ck").exists()
