"""Helpers shared by the test files. A test file imports from here, never from another test file.

How the tests are organised:
- one file per layer and concern (test_io_*, test_store*, test_partition*, test_quant_*, test_zero*); a file
  ending in `_dist` runs the same layer across processes (gloo on CPU);
- tests/support (this package): the models and data several files train (support.models), the
  Zero3Optimizer config and comparison helpers (support.zero), peak-memory measurement (support.memory) and
  the one multi-process launcher (support.dist). `tests` is importable because pyproject's pytest options put
  the checkout on the path (`pythonpath = ["."]`): write `from tests.support import Net, run_ranks`;
- tests observe the library through its public surface: `Store.stats()`, `Zero3Optimizer.stats()`,
  `ParamCoordinator.stats()` (frozen snapshots of counters), read-only properties such as
  `Store.generation` and `Init.stored_chunks`. Reaching into a private attribute is kept for setting up a
  fault (an injected I/O error, a forced code path), said so in a comment next to it.

A multi-process test: write the per-rank body as a module-level function of the test file, taking
(rank, world, *args) and returning what the parent checks (tensors, dicts, numbers), and call
`run_ranks(fn, world, *args)` from the test. The launcher starts the ranks from one fork server, joins them
in a gloo group, returns each rank's result by rank, and fails the test with the failing rank's traceback,
or after a timeout if the ranks hang. Assert in the parent where you can (the failure then names the test,
not a rank). Ranks are slow to start on a busy machine: run several scenarios in one launch (see
test_zero_dist.py) rather than one launch per test.
"""
from .dist import RanksFailed, run_isolated, run_ranks
from .memory import peak_growth, rss_follows_live_memory
from .models import Branchy, Checkpointed, Deep, Net, Odd, batches, loss_fn, make_pair
from .zero import cfg, flip_byte, max_rel, reference

__all__ = ["Branchy", "Checkpointed", "Deep", "Net", "Odd", "RanksFailed", "batches", "cfg", "flip_byte", "loss_fn",
           "make_pair", "max_rel", "peak_growth", "reference", "rss_follows_live_memory", "run_isolated",
           "run_ranks"]
