"""How an embedding model turns its final hidden states into one vector: the pooling its
sentence-transformers configuration asks for (modules.json -> the Pooling module's config.json, in
either spelling: `"pooling_mode": "lasttoken"` since sentence-transformers 6, `pooling_mode_*` booleans
before), and whether a Normalize module follows. Decoder embedding models (Qwen3-Embedding,
e5-mistral, gte-Qwen) pool the last token; mean pooling averages every token; CLS pooling takes the
first (BERT-style checkpoints)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' names -> ours, in its older boolean keys and its newer `pooling_mode` string.
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}


@dataclass(frozen=True, slots=True)
class Pooling:
    method: str = "last"
    normalize: bool = True
    # sentence-transformers 6 saves a chat-template model with a "message" modality: it renders each text
    # as one user message through the model's chat template before tokenizing it; older saves do not.
    chat_template: bool = False


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
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        method = _MODE_NAMES.get(mode)
        found = [mode]
    else:
        found = sorted(key for key, value in config.items() if key.startswith("pooling_mode") and value is True)
        methods = {_MODE_KEYS.get(key) for key in found}
        method = methods.pop() if len(methods) == 1 else None
    if method is None:
        raise ValueError(f"{config_file}: pooling {', '.join(found) or 'none'} is not supported "
                         "(last-token, mean and CLS pooling are, one at a time)")
    return Pooling(method, any(t.endswith("Normalize") for t in types), _renders_messages(model_dir))


def _renders_messages(model_dir: Path) -> bool:
    config_file = model_dir / "sentence_bert_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    return isinstance(modalities, dict) and "message" in modalities
