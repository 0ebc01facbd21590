"""Equal memory for the cases of a benchmark: each case's process in a memory cgroup of its own with the same
limit, or -- where there is no cgroup to be had -- its files' pages dropped from the page cache before each round.

[Note: equal memory for every case]
A model whose files fit in the page cache is read from memory by whatever maps them (accelerate's numpy memmaps)
after the first token, while O_DIRECT reads go to the disk every token: a comparison of the two measures the
page cache, not the readers. So every case that keeps its weights on the disk runs in a cgroup v1 memory
controller group of its own (created below the group this process runs in, so a limit above it still applies)
whose limit is the same for all of them; on cgroup v1 the page cache a process faults in is charged to its
group, so a memmap cannot keep more of the model cached than the limit leaves it. Pages cached before the process
joined stay charged to whoever faulted them -- and would be read for free -- so the files of every case are
dropped from the page cache (fsync, POSIX_FADV_DONTNEED) before the limit is set. Where the controller is
missing or not writable (not root, cgroup v2 only) the benchmark says so and only drops the files' pages before
each round: within a round a model that fits in memory is then read from the page cache after its first pass.
"""
from __future__ import annotations

import os

V1_ROOT = "/sys/fs/cgroup/memory"


class MemoryGroup:
    """One cgroup v1 memory group; processes join with ``add(pid)``; ``limit(bytes)`` caps what they use (anonymous
    memory and page cache together); ``close()`` removes it once they exited."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, tag: str) -> tuple[MemoryGroup | None, str]:
        """(a new group, '') or (None, why not)."""
        parent = _own_group()
        if parent is None:
            return None, f"no cgroup v1 memory controller at {V1_ROOT}"
        path = os.path.join(parent, f"tierstore-bench-{os.getpid()}-{tag}")
        try:
            os.mkdir(path)
        except OSError as e:
            return None, f"cannot create a memory cgroup under {parent} ({e.strerror}; root is needed)"
        return cls(path), ""

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def limit(self, nbytes: int) -> str:
        """Set the limit; '' or why it could not be (the group uses more than `nbytes` it cannot give back)."""
        try:
            self._write("memory.limit_in_bytes", str(nbytes))
        except OSError as e:
            return f"limit {nbytes} refused ({e.strerror}): the process holds {self.usage()} bytes it cannot give back"
        return ""

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes")

    def peak(self) -> int:
        """The most the group used since ``reset_peak`` (bytes: anonymous memory and page cache)."""
        return self._read("memory.max_usage_in_bytes")

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")

    def close(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> int:
        with open(os.path.join(self.path, name)) as f:
            return int(f.read())


def _own_group() -> str | None:
    """The cgroup v1 memory group this process is in (a directory), or None."""
    if not os.path.isfile(os.path.join(V1_ROOT, "memory.limit_in_bytes")):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, rel = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    path = os.path.join(V1_ROOT, rel.lstrip("/"))
                    return path if os.path.isdir(path) else None
    except OSError:
        return None
    return None


def drop_files(root: str) -> int:
    """Flush every file under `root` and drop its pages from the page cache; returns how many files."""
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n
