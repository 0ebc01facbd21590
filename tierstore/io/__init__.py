"""The I/O layer: asynchronous aligned reads/writes (io_uring or threads) and a page-locked buffer pool."""
from .engine import Backend, Engine, FaultInjector, IOFuture, Piece, io_uring_status
from .files import ALIGN, File, StripedFile
from .pool import Buffer, BufferPool, memlock_limit
from .tuning import Tuning

__all__ = ["ALIGN", "Backend", "Buffer", "BufferPool", "Engine", "FaultInjector", "File", "IOFuture", "Piece",
           "StripedFile", "Tuning", "io_uring_status", "memlock_limit"]
