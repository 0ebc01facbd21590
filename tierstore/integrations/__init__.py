"""Where users train: transformers' Trainer and accelerate, over Zero3Optimizer. See docs/integrations.md.

    from tierstore.integrations.trainer import TierstoreTrainer        # pip install 'tierstore[transformers]'
    from tierstore.integrations.accelerate import prepare             # pip install 'tierstore[accelerate]'

Each module imports its framework when it is imported (not this package), and raises an ImportError naming
the extra to install when the framework is missing. They use only tierstore.zero's public API.
"""
from __future__ import annotations

__all__: list[str] = []
