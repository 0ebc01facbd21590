"""One wording for a missing optional framework: which extra installs it."""
from __future__ import annotations


def missing(module: str, extra: str, version: str) -> str:
    """The message of the ImportError raised when `module` is not installed."""
    return (f"tierstore.integrations needs {module} ({module}=={version} is the version tested): "
            f"pip install 'tierstore[{extra}]'")
