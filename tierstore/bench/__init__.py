"""Benchmarks behind `tierstore bench <name>`; helpers shared by all of them live in ``_common``."""
