"""tierstore: keep tensors on accelerator memory, page-locked host memory and NVMe files, and move them fast."""
from . import errors, zero
from .activations import ActivationOffload
from .errors import CorruptionError, MisuseError, PinnedMemoryError, TierFullError, TierstoreError, TierstoreIOError
from .store import Store
from .tensor import TieredTensor
from .zero import OffloadConfig, Zero3Optimizer

__version__ = "0.1.0"

__all__ = ["ActivationOffload", "CorruptionError", "MisuseError", "PinnedMemoryError", "TierFullError",
           "TierstoreError", "TierstoreIOError", "Store", "TieredTensor", "errors", "__version__", "OffloadConfig",
           "Zero3Optimizer", "zero"]
