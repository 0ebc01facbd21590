"""The test suite. Shared helpers live in tests/support (see its docstring)."""
