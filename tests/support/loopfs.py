"""Small real filesystems for fault tests: an image under a pytest tmp dir, loop-mounted (root only), that a
test can fill, shut down (FS_IOC_SHUTDOWN, as xfstests' godown does), remount or make read-only. `mounted`
is the fixture body every user shares: it skips with the reason where loop mounts cannot be had and
unmounts (detaching the loop device) even when the test fails."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
import subprocess
import time

import pytest

FS_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
SHUTDOWN_NOLOGFLUSH = 2  # like a power cut: what the journal has not committed is gone


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def loop_mount_unavailable() -> str | None:
    """Why a loop-mounted filesystem cannot be had here (None when it can)."""
    if os.geteuid() != 0:
        return "loop-mounting needs root (the power-loss and full-disk campaigns mount small ext4 images)"
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control: this kernel or container has no loop devices"
    return None


class LoopFS:
    """A small filesystem image under a pytest tmp dir, mounted with `mount -o loop`; remountable, and
    unmounted (its loop device detached) by `cleanup`, which the fixture calls even when a test fails."""

    def __init__(self, root: str, fstype: str = "ext4", mib: int = 48):
        self.image = os.path.join(root, f"{fstype}.img")
        self.mnt = os.path.join(root, f"mnt-{fstype}")
        self.fstype = fstype
        os.makedirs(self.mnt, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(mib << 20)
        mk = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard"] if fstype == "ext4" else ["mkfs.xfs", "-q", "-f"]
        r = _run(*mk, self.image)
        if r.returncode:
            raise RuntimeError(f"{' '.join(mk)} failed: {r.stderr}")
        self.mounted = False

    def mount(self) -> None:
        r = _run("mount", "-o", "loop", "-t", self.fstype, self.image, self.mnt)
        if r.returncode:
            raise RuntimeError(f"mount -o loop {self.image} failed: {r.stderr.strip()}")
        self.mounted = True

    def umount(self) -> None:
        for _ in range(100):  # a killed child's io_uring workers may hold the fs for a moment
            r = _run("umount", self.mnt)
            if r.returncode == 0:
                self.mounted = False
                return
            time.sleep(0.05)
        raise RuntimeError(f"umount {self.mnt} failed: {r.stderr}")

    def shutdown(self, flag: int = SHUTDOWN_NOLOGFLUSH) -> None:
        """FS_IOC_SHUTDOWN (xfstests' godown): NOLOGFLUSH loses everything not yet durable, like a power cut."""
        fd = os.open(self.mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("I", flag))
        finally:
            os.close(fd)

    def remount_ro(self) -> None:
        """Remount read-only (a read-only medium)."""
        r = _run("mount", "-o", "remount,ro", self.mnt)
        if r.returncode:
            raise RuntimeError(f"remount,ro {self.mnt} failed: {r.stderr}")
        try:  # really read-only now
            os.close(os.open(os.path.join(self.mnt, ".probe"), os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
        else:
            raise RuntimeError(f"{self.mnt} still takes writes after remount,ro")

    def fill(self) -> str:
        """Write a filler file until the filesystem is full (down to its last 1 KiB); returns its path."""
        path = os.path.join(self.mnt, "filler")
        chunk = b"\xff" * (64 << 10)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for size in (len(chunk), 4096, 1024):
                try:
                    while True:
                        os.write(fd, chunk[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    def free_bytes(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_bavail * st.f_frsize

    def cleanup(self) -> None:
        if self.mounted or os.path.ismount(self.mnt):
            _run("umount", "-l", self.mnt)
            self.mounted = False
        # a loop device left attached to the image (a failed umount) is detached too
        r = _run("losetup", "-j", self.image)
        for line in r.stdout.splitlines():
            _run("losetup", "-d", line.split(":")[0])


def mounted(tmp_path, fstype: str = "ext4", mib: int = 48):
    """Generator body of a fixture: a mounted LoopFS, skipped with the reason where none can be had."""
    why = loop_mount_unavailable()
    if why:
        pytest.skip(why)
    if fstype == "xfs" and shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed (Debian package xfsprogs): the xfs runs are skipped")
    fs = LoopFS(str(tmp_path), fstype, mib)
    try:
        try:
            fs.mount()
        except RuntimeError as e:
            pytest.skip(f"loop mounts are not allowed here ({e})")
        yield fs
    finally:
        fs.cleanup()
