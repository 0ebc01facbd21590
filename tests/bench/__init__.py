"""The benchmarks' own logic (verdicts, step accounting)."""
