"""How an embedding model turns its final hidden states into one vector: the pooling its
sentence-transformers configuration asks for (modules.json -> the Pooling module's config.json), and
whether a Normalize module follows. Decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen)
pool the last token; mean pooling averages every token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class Pooling:
    method: str = "last"
    normalize: bool = True


def sentence_transformers_pooling(model_dir: Path) -> Pooling | None:
    """The pooling a sentence-transformers checkpoint declares; None when it is not one. ValueError
    for a pooling mode crane-mp does not implement."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return None
    config_file = model_dir / pooling.get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("pooling_mode_lasttoken"):
        method = "last"
    elif config.get("pooling_mode_mean_tokens"):
        method = "mean"
    else:
        modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
        raise ValueError(f"{config_file}: pooling {', '.join(modes) or 'none'} is not supported "
                         "(last-token and mean pooling are)")
    return Pooling(method, any(t.endswith("Normalize") for t in types))
