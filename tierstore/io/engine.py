"""Engine: asynchronous reads and writes of host buffers at file offsets -- requests split into pieces,
bounced where unaligned, submitted to a backend (backends.py), waited for within a stall bound.

    eng = Engine()                                # io_uring when the kernel allows it, else threads
    f = eng.open("/nvme0/x.bin")                  # O_DIRECT where the filesystem allows it
    fut = eng.write(f, tensor_or_buffer, offset)  # a Future; result() is the byte count
    eng.wait_all()                                # raises the first error since the last wait_all

[Note: requests and pieces]
A request (one read/write call) becomes pieces: one per stripe a striped file maps it to, each split in
`block_size` blocks. On a file opened with O_DIRECT every block goes through the O_DIRECT descriptor:
straight from/into the caller's memory where its address, file offset and length are 4 KiB aligned, else
through the engine's bounce buffers (see [Note: bounce buffers]). All pieces are in flight together, up
to `queue_depth` at once; the request's future resolves when the *last* piece has finished, so the
caller's buffer is never reused while the kernel may still touch it, and carries the first error (naming
the file, offset and length of the failed piece -- the caller's range, not the bounce buffer's).

[Note: bounce buffers]
A block whose buffer address (or file offset, or length) is not 4 KiB aligned -- an ordinary torch tensor
is 64-byte aligned -- cannot go to the O_DIRECT descriptor as it is, and the buffered descriptor is many
times slower on a large transfer (the page cache copies it and writes it back later). So such a block is
copied through one of the engine's own bounce buffers (a small, huge-page advised pool, registered with
io_uring with the caller's pool): a write copies block i+1 in while block i is in flight; a read lands in
a bounce buffer covering the block's 4 KiB-aligned range and is copied out when it completes -- with
io_uring on two copy threads, not on the one thread that completes every request of the engine. The first
such request of an engine is logged once at INFO, naming why. Only two things still use the buffered
descriptor of an O_DIRECT file: the partial 4 KiB blocks at the ends of a *write* whose file range is not
4 KiB aligned -- an O_DIRECT write of them would be a read-modify-write of a block another request may be
writing at the same time, which the page cache serialises and O_DIRECT does not; `stats()` counts them.
A filesystem that refuses O_DIRECT (ramfs, some network filesystems) gets buffered I/O for everything,
and files.py says so once per filesystem.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import (
    BackendUnavailableError,
    IOStalledError,
    MisuseError,
    TierstoreIOError,
    TierstoreValueError,
)
from .backends import FAULTS, Backend, FaultInjector, _ThreadBackend, _UringBackend, io_uring_status
from .files import ALIGN, File, StripedFile
from .pieces import OPNAME, READ, WRITE, IOFuture, Piece, buffer_address
from .pool import BufferPool
from .stall import Progress, stall_seconds, wait_bounded
from .tuning import Tuning

__all__ = ["Backend", "Engine", "FaultInjector", "IOFuture", "Piece", "buffer_address", "io_uring_status"]

log = logging.getLogger("tierstore.io")


class Engine:
    """Asynchronous file I/O of host buffers.

    backend: "auto" (io_uring, else a thread pool, saying why in the log), "io_uring" or "threads".
    queue_depth: requests in flight at once. block_size: a request is split into pieces of this many
    bytes, in flight together. direct: open files with O_DIRECT where possible.
    pool: a BufferPool whose memory is registered with io_uring (fixed buffers).
    bounce_bytes: the engine's own bounce buffers for unaligned memory (see [Note: bounce buffers]).
    stall_timeout: seconds without any completed request after which a wait raises IOStalledError naming
    what is pending (default $TIERSTORE_IO_STALL_S or 300; see [Note: bounded waits] in stall.py).
    `Engine.from_tuning(path)` builds one from what `tierstore tune` recommended.
    """

    def __init__(self, backend: str = "auto", queue_depth: int = 32, block_size: int = 1 << 20, *,
                 direct: bool = True, pool: BufferPool | None = None, bounce_bytes: int = 32 << 20,
                 stall_timeout: float | None = None):
        if backend not in ("auto", "io_uring", "threads"):
            raise TierstoreValueError(f"backend={backend!r}; choose 'auto', 'io_uring' or 'threads'")
        if not 1 <= queue_depth <= 4096:
            raise TierstoreValueError(f"queue_depth={queue_depth} must be in 1..4096")
        if block_size < ALIGN or block_size % ALIGN:
            raise TierstoreValueError(f"block_size={block_size} must be a positive multiple of {ALIGN} bytes")
        if isinstance(bounce_bytes, bool) or not isinstance(bounce_bytes, int) or bounce_bytes < 0:
            raise TierstoreValueError(f"bounce_bytes={bounce_bytes!r} must be an int >= 0 (bytes)")
        self._progress = Progress(stall_seconds(stall_timeout))
        self.queue_depth = queue_depth
        self.block_size = block_size  # bytes
        self.direct = direct
        self._backend: Backend
        if backend in ("auto", "io_uring"):
            ok, why = io_uring_status()
            if ok:
                self._backend = _UringBackend(queue_depth)
            elif backend == "io_uring":
                raise BackendUnavailableError(f"backend='io_uring' requested but {why}; use backend='auto' "
                                              "or 'threads'")
            else:
                log.warning("tierstore: %s; falling back to the thread-pool backend", why)
                self._backend = _ThreadBackend(queue_depth)
        else:
            self._backend = _ThreadBackend(queue_depth)
        # Bounce buffers: a block plus the 4 KiB a read's aligned cover may add; at least two, so a copy
        # overlaps a transfer. Not page-locked (the kernel pins what is in flight); untouched until used.
        bb = block_size + ALIGN
        self._bounce = BufferPool(max(2 * bb, bounce_bytes // bb * bb), bb, lock=False)
        self._counts = {"direct": 0, "bounced": 0, "buffered": 0}  # bytes by path (see stats())
        self._bounce_logged = False
        self._copier: ThreadPoolExecutor | None = None  # bounced reads' copy-out (io_uring), started when needed
        self.buffers_registered = False
        if pool is not None:
            self.register_pool(pool)
        else:
            self._backend.register_buffers(self._bounce.regions())
        self._files: dict[str, File] = {}
        self._owned: list[File | StripedFile] = []
        self._lock = threading.Lock()
        self._outstanding: set[IOFuture] = set()
        self._failed: list[Future] = []
        self._closed = False

    @property
    def backend(self) -> str:
        """Which backend runs: 'io_uring' or 'threads'."""
        return self._backend.name

    def register_pool(self, pool: BufferPool) -> bool:
        """Register the pool's memory as fixed buffers (io_uring). Returns whether the kernel took it. The
        bounce buffers are registered with it where the page-lock limit allows both, else the pool alone."""
        self.buffers_registered = (self._backend.register_buffers(pool.regions() + self._bounce.regions())
                                   or self._backend.register_buffers(pool.regions()))
        return self.buffers_registered

    @classmethod
    def from_tuning(cls, path: str | os.PathLike, **overrides) -> Engine:
        """An engine with the knobs `tierstore tune` wrote to `path` (see tierstore/io/tuning.py); keyword
        arguments override them."""
        return cls(**{**Tuning.load(path).engine_kwargs(), **overrides})

    def stats(self) -> dict:
        """Bytes moved so far by path: 'direct' (O_DIRECT from/into the caller's memory), 'bounced' (O_DIRECT
        through the bounce buffers) and 'buffered' (the page cache: a filesystem without O_DIRECT, or the
        partial end blocks of an unaligned write), plus the bounce buffers' count, size and how many are free."""
        with self._lock:
            out = dict(self._counts)
        out["bounce_buffers"] = self._bounce.count
        out["bounce_buffer_bytes"] = self._bounce.buffer_bytes
        out["bounce_buffers_free"] = self._bounce.free  # given back: all of them when nothing is in flight
        return out

    # -- files ----------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike, mode: str = "c", *, direct: bool | None = None) -> File:
        """Open a file for this engine. Modes: 'r', 'r+', 'w' (truncate), 'c' (create, keep contents)."""
        self._check_open()
        f = File(path, mode, direct=self.direct if direct is None else direct)
        self._backend.register_file(f)
        with self._lock:
            self._owned.append(f)
        return f

    def open_striped(self, dirs: Sequence[str | os.PathLike], name: str, mode: str = "c", *,
                     stripe_unit: int = 1 << 20, direct: bool | None = None) -> StripedFile:
        """One logical file striped RAID-0 over `dirs` (one per drive), `stripe_unit` bytes per stripe."""
        self._check_open()
        sf = StripedFile(dirs, name, mode, stripe_unit=stripe_unit, direct=self.direct if direct is None else direct)
        for f in sf.parts:
            self._backend.register_file(f)
        with self._lock:
            self._owned.append(sf)
        return sf

    def close_file(self, f: File | StripedFile) -> None:
        """Close a file opened by this engine. Its requests must have finished."""
        for part in f.files():
            self._backend.unregister_file(part)
        f.close()
        with self._lock:
            if f in self._owned:
                self._owned.remove(f)

    def _resolve(self, file: File | StripedFile | str | os.PathLike, op: int) -> File | StripedFile:
        if isinstance(file, (File, StripedFile)):
            if file.closed:
                raise MisuseError(f"{file!r} is closed; open it again with engine.open()")
            return file
        path = os.path.abspath(os.fspath(file))
        with self._lock:
            f = self._files.get(path)
        if f is None:
            f = self.open(path, "r+" if os.path.exists(path) else ("c" if op == WRITE else "r"))
            with self._lock:
                self._files.setdefault(path, f)
                f = self._files[path]
        return f

    # -- requests -------------------------------------------------------------------------------
    def read(self, file, buffer, offset: int = 0) -> IOFuture:
        """Read len(buffer) bytes at `offset` of `file` (a File, StripedFile or path) into `buffer`."""
        return self._submit(READ, file, [(buffer, offset)])

    def write(self, file, buffer, offset: int = 0) -> IOFuture:
        """Write `buffer` at `offset` of `file` (a File, StripedFile or path)."""
        return self._submit(WRITE, file, [(buffer, offset)])

    def read_many(self, file, requests) -> IOFuture:
        """Read each (buffer, offset) of `requests` from `file`, all submitted as one batch.

        One future for the batch: its result is the total bytes, its error the first failed request's (naming
        that request's offset and length). For many small transfers this costs a fraction of single calls."""
        return self._submit(READ, file, list(requests))

    def write_many(self, file, requests) -> IOFuture:
        """Write each (buffer, offset) of `requests` to `file`, all submitted as one batch (see read_many)."""
        return self._submit(WRITE, file, list(requests))

    def _submit(self, op: int, file, requests: list) -> IOFuture:
        self._check_open()
        f = self._resolve(file, op)
        pieces: list[Piece] = []
        keep, total = [], 0
        for buffer, offset in requests:
            if offset < 0:
                raise TierstoreValueError(f"offset={offset} must be >= 0")
            addr, nbytes, k = buffer_address(buffer, writable=op == READ)
            keep.append(k)
            pieces.extend(self._pieces(op, f, addr, nbytes, offset))
            total += nbytes
        fut = IOFuture(op, f.path, min((o for _, o in requests), default=0), total, keep, self._progress)
        if not pieces:
            fut.set_result(0)
            return fut
        counts = dict.fromkeys(self._counts, 0)
        straight, bounced = [], []
        for p in pieces:
            p.fut = fut
            if p.bounce is not None:
                bounced.append(p)
                counts["bounced"] += p.want
            else:
                straight.append(p)
                counts["direct" if p.direct else "buffered"] += p.length
        fut._left = len(pieces)
        with self._lock:
            if not self._outstanding:  # busy from idle: the stall clock starts now ([Note: bounded waits])
                self._progress.tick()
            self._outstanding.add(fut)
            for key, v in counts.items():
                self._counts[key] += v
            first_bounce = bool(bounced) and not self._bounce_logged
            self._bounce_logged = self._bounce_logged or first_bounce
        if first_bounce:
            p = bounced[0]
            why = (f"its buffer address {p.user:#x}" if p.user % ALIGN else
                   f"its file offset {p.offset + p.skip}" if (p.offset + p.skip) % ALIGN else f"its length {p.want}")
            log.info("a %s of %s: %s is not %d-byte aligned, so unaligned blocks go through the "
                     "engine's O_DIRECT bounce buffers (one extra copy); 4 KiB-aligned memory (a BufferPool "
                     "buffer, tierstore.tiers.host.aligned_empty) skips the copy", OPNAME[op], f.path, why, ALIGN)
        fut.add_done_callback(self._on_done)
        if straight:
            self._backend.submit_many(straight)
        if bounced:
            self._submit_bounced(op, bounced)
        return fut

    def _submit_bounced(self, op: int, pieces: list[Piece]) -> None:
        """Lease a bounce buffer per piece, as they free up, and submit (see [Note: bounce buffers]): a write
        is copied in and submitted at once, so the copy of the next overlaps its transfer; reads are
        submitted in batches of the buffers free at the time, each copied out as it completes."""
        copier = None
        if op == READ and self.backend == "io_uring":  # its one collector thread completes everything
            with self._lock:
                if self._copier is None:
                    self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-bounce")
                copier = self._copier
        i = 0
        try:
            while i < len(pieces):
                batch = [pieces[i]]
                batch[0].bounce = self._bounce.lease()
                if op == READ:
                    while i + len(batch) < len(pieces):
                        buf = self._bounce.try_lease()
                        if buf is None:
                            break
                        pieces[i + len(batch)].bounce = buf
                        batch.append(pieces[i + len(batch)])
                for p in batch:
                    p.addr, p.copier = p.bounce.addr, copier
                    if op == WRITE:
                        ctypes.memmove(p.addr, p.user, p.want)
                i += len(batch)
                self._backend.submit_many(batch)
        except BaseException as e:  # never leave a request's future unresolved
            for p in pieces[i:]:
                p.fail(e)
            raise

    def _pieces(self, op, f, addr, nbytes, offset):
        """The pieces of one request (see [Note: requests and pieces]); their future is set by the caller. A
        bounced piece gets its bounce buffer (and so its address) when it is submitted."""
        bs = self.block_size
        for part, phys, boff, length in f.map(offset, nbytes):
            a = addr + boff
            if part.direct_fd is None:  # the filesystem refuses O_DIRECT (files.py logged it)
                for o in range(0, length, bs):
                    yield Piece(None, op, part, part.fd, a + o, min(bs, length - o), phys + o, False)
                continue
            pos, end = 0, length
            if op == WRITE and phys % ALIGN:  # the partial first block of an unaligned write: buffered
                head = min(end, ALIGN - phys % ALIGN)
                yield Piece(None, op, part, part.fd, a, head, phys, False)
                pos = head
            if op == WRITE:  # ... and the partial last block
                tail = (phys + end) % ALIGN if end > pos else 0
                if tail:  # (phys + end - tail is 4 KiB aligned, so it is >= phys + pos)
                    end -= tail
                    yield Piece(None, op, part, part.fd, a + end, tail, phys + end, False)
            for o in range(pos, end, bs):
                n = min(bs, end - o)
                pa, po = a + o, phys + o
                if pa % ALIGN == 0 and po % ALIGN == 0 and n % ALIGN == 0:
                    yield Piece(None, op, part, part.direct_fd, pa, n, po, True)
                    continue
                if pa % ALIGN == 0 and po % ALIGN == 0 and n > ALIGN:  # a read's unaligned tail: bounce it alone
                    body = n - n % ALIGN
                    yield Piece(None, op, part, part.direct_fd, pa, body, po, True)
                    pa, po, n = pa + body, po + body, n - body
                lo = po - po % ALIGN  # the aligned cover of [po, po + n)
                cover = (po + n - lo + ALIGN - 1) // ALIGN * ALIGN
                yield Piece(None, op, part, part.direct_fd, 0, cover, lo, True, bounce=True, user=pa, skip=po - lo,
                            want=n)

    def _on_done(self, fut: Future) -> None:  # an IOFuture
        with self._lock:
            self._outstanding.discard(fut)
            if fut.exception() is not None:
                self._failed.append(fut)

    def wait_all(self) -> None:
        """Wait for every request submitted so far; raise the first error since the last wait_all(), or
        IOStalledError naming what is pending once nothing completed for the stall bound ([Note: bounded
        waits] in stall.py)."""
        while True:
            with self._lock:
                pending = list(self._outstanding)
            if not pending:
                break
            wait_bounded(pending, self._progress, self._pending)
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            error = failed[0].exception()
            assert error is not None  # only futures that failed are kept
            raise error

    def wait_for(self, futures) -> None:
        """Wait until every future of `futures` is done -- futures of a layer above (a write through a staging
        buffer) that this engine's requests complete -- bounded as the engine's own waits are: IOStalledError
        naming the engine's pending requests once none completed for the stall bound ([Note: bounded waits]
        in stall.py). Errors stay on the futures."""
        wait_bounded(futures, self._progress, self._pending)

    def _pending(self) -> list[IOFuture]:
        with self._lock:
            return [f for f in self._outstanding if not f.done()]

    def fsync(self, file: File | StripedFile) -> None:
        """Make everything written to `file` durable."""
        file.fsync()

    def inject_fault(self, nth: int, kind: str) -> None:
        """Test-only: make the nth I/O completion from now fail with EIO / ENOSPC, or come back short."""
        if kind not in FAULTS:
            raise TierstoreValueError(f"kind={kind!r}; choose one of {sorted(FAULTS)}")
        self._backend.faults.arm(nth, FAULTS[kind])

    def _check_open(self) -> None:
        if self._closed:
            raise MisuseError("the engine is closed; create a new Engine")

    def close(self) -> None:
        """Wait for what is in flight, then release the ring/threads and close the files it opened."""
        if self._closed:
            return
        try:
            self.wait_all()
        except IOStalledError:
            # what is pending may still be touched by the kernel or a backend thread: keep the backend, files
            # and buffers alive, and say what stalled ([Note: bounded waits] in stall.py)
            self._closed = True
            raise
        except TierstoreIOError:
            pass  # reported through the futures already
        self._closed = True
        self._backend.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._bounce.close()
        with self._lock:
            owned, self._owned = self._owned, []
            self._files.clear()
        for f in owned:
            f.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine(backend={self.backend!r}, queue_depth={self.queue_depth}, block_size={self.block_size})"
