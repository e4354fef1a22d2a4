"""The built-in demo model: the `small` random-weight Qwen3, generated once into a cache directory.

Random weights produce nonsense text, but every code path (chat template, tokenizer, batching,
streaming) is real, so a newcomer can run the server with no weights of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

from crane_mp.config import cache_root

DEMO_ARCH = "qwen3"
DEMO_SIZE = "small"
DEMO_DTYPE = "bfloat16"


def demo_model_path() -> Path:
    """Return the demo checkpoint directory, generating it on first use (a few seconds)."""
    path = cache_root() / f"demo-{DEMO_ARCH}-{DEMO_SIZE}"
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    from crane_mp.testing.make_model import make_model

    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    make_model(DEMO_ARCH, DEMO_SIZE, staging, dtype=DEMO_DTYPE)
    staging.rename(path)  # atomic: a concurrent or interrupted first run never leaves a half-written model
    return path
