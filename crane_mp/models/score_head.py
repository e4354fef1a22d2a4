"""A sequence-classification checkpoint's head (`--task score`): transformers' *ForSequenceClassification
of a decoder puts a linear `score` layer on the last token's final hidden state, BERT's and RoBERTa's a
dense + tanh pooler and a linear layer on the first token's; sentence-transformers' CrossEncoder then
applies its activation (as its configuration names it; Sigmoid by default for one label). The worker
pools that hidden state (not normalised) and the frontend applies this head to it, so the worker
serves the checkpoint as it serves an embedding model.

A Qwen3-Reranker-style causal model gets a head too (answer_head): its recipe, p(yes) / (p(yes) +
p(no)) for the next token, is the sigmoid of the two tokens' logit difference, a dot product of the
same pooled state with the difference of their LM-head rows."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from crane_mp.models.gguf_file import ModelSource, check_gguf


def classifies(model_dir: Path | None) -> bool:
    """The checkpoint is a transformers sequence-classification model."""
    config_file = model_dir / "config.json" if model_dir is not None else None
    if config_file is None or not config_file.is_file():
        return False
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


# Where a sequence-classification checkpoint keeps its head: (pooler, output layer, pooling). A decoder's
# `score` layer reads the last token; BERT's pooler (dense + tanh) and RoBERTa's classifier.dense read
# the first ([CLS], <s>) before their output layer.
_HEADS = ((None, "score", "last"), ("bert.pooler.dense", "classifier", "cls"),
          ("classifier.dense", "classifier.out_proj", "cls"))


@dataclass(frozen=True)
class ScoreHead:
    weight: np.ndarray  # [hidden] float32: one label
    bias: float
    sigmoid: bool
    # sentence-transformers 6 gives a model with a chat template the "message" modality: a pair is then
    # two messages, roles query and document, rendered by the template ("structured": content as text
    # parts; "flat": strings); None: the tokenizer's own text-pair encoding.
    pair_format: str | None = None
    pooling: str = "last"  # which token's final hidden state the engine pools for it
    pooler: tuple[np.ndarray, np.ndarray] | None = None  # an encoder's dense + tanh before `weight`
    # A decoder head reads the last token that is not config.json's pad token (transformers finds a
    # row's end by it, whatever side its batch pads).
    pad_id: int | None = None
    prompt: str | None = None  # the CrossEncoder's default prompt (a system message, or the query's prefix)

    def pooled_ids(self, ids: list[int]) -> list[int]:
        """A pair's prompt up to the token the head reads: trailing pad tokens dropped (a causal model's
        state at that token does not depend on them), the first token kept whatever it is."""
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad_id:
            end -= 1
        return ids[:end]

    def score(self, hidden: bytes) -> float:
        """The label's score from a pooled hidden state (float32 bytes)."""
        values = np.frombuffer(hidden, dtype=np.float32)[: self.weight.shape[0]]
        if self.pooler is not None:
            values = np.tanh(self.pooler[0] @ values + self.pooler[1])
        logit = float(np.dot(self.weight, values)) + self.bias
        return 1.0 / (1.0 + math.exp(-logit)) if self.sigmoid else logit


def load_score_head(model_dir: Path, chat_template: str | dict | None = None) -> ScoreHead:
    """The head of `model_dir`'s checkpoint, whose tokenizer has `chat_template`; ValueError where it
    has none, or more than one label."""
    names = {f"{layer}.{kind}" for pooler, output, _ in _HEADS for layer in (pooler, output) if layer
             for kind in ("weight", "bias")}
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:  # torch reads bf16, numpy does not
            for name in names & set(handle.keys()):
                tensors[name] = handle.get_tensor(name).float().numpy()
    head = next(((pooler, output, pooling) for pooler, output, pooling in _HEADS
                 if f"{output}.weight" in tensors and (pooler is None or f"{pooler}.weight" in tensors)), None)
    if head is None:
        raise ValueError(f"{model_dir}: no `score.weight` or `classifier` tensor: not a sequence-classification "
                         "checkpoint")
    pooler, output, pooling = head
    weight = tensors[f"{output}.weight"]
    if weight.shape[0] != 1:
        raise ValueError(f"{model_dir}: the head has {weight.shape[0]} labels; --task score serves one-label heads")
    config = _json(model_dir / "config.json")
    settings = _json(model_dir / "config_sentence_transformers.json")
    bias = float(tensors[f"{output}.bias"][0]) if f"{output}.bias" in tensors else 0.0
    dense = (tensors[f"{pooler}.weight"], tensors[f"{pooler}.bias"]) if pooler else None
    pad_id = config.get("pad_token_id") if pooling == "last" else None
    prompt = (settings.get("prompts") or {}).get(settings.get("default_prompt_name"))
    return ScoreHead(weight[0], bias, _activation(model_dir, config, settings) == "Sigmoid",
                     _pair_format(model_dir, config, chat_template), pooling, dense, pad_id, prompt)


def _activation(model_dir: Path, config: dict, settings: dict) -> str:
    """The activation CrossEncoder applies: the first it trusts (a torch class) of its own settings,
    config.json's (before sentence-transformers 4: `sbert_ce_default_activation_function`), else Sigmoid,
    its default for one label."""
    saved = (settings.get("activation_fn"), (config.get("sentence_transformers") or {}).get("activation_fn"),
             config.get("sbert_ce_default_activation_function"))
    path = next((path for path in saved if isinstance(path, str) and path.startswith("torch.")), "torch.nn.Sigmoid")
    name = path.rsplit(".", 1)[-1]
    if name not in ("Sigmoid", "Identity"):
        raise ValueError(f"{model_dir}: activation {path} is not supported (Sigmoid and Identity are)")
    return name


# sentence-transformers' InputFormatter._infer_format: the model types it knows take flat (string) content;
# otherwise a template that reads typed parts says so by one of these.
_FLAT_MODEL_TYPES = frozenset({"apertus", "deepseek_v3", "gpt_oss", "seed_oss"})
_STRUCTURED_MARKS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


def _pair_format(model_dir: Path, config: dict, chat_template: str | dict | None) -> str | None:
    """How CrossEncoder turns a pair into tokens: through the chat template as query and document messages
    where its saved modality config has "message", or (none saved) where the tokenizer has a template;
    else (None) the tokenizer's text-pair encoding."""
    modalities = _json(model_dir / "sentence_bert_config.json").get("modality_config")
    if isinstance(modalities, dict):
        message = modalities.get("message")
        if not isinstance(message, dict):
            return None
        spelled = message.get("format", "auto")
    elif chat_template:
        spelled = "auto"
    else:
        return None
    if spelled != "auto":
        return spelled
    if config.get("model_type") in _FLAT_MODEL_TYPES:
        return "flat"
    if not isinstance(chat_template, str) or any(mark in chat_template for mark in _STRUCTURED_MARKS):
        return "structured"
    return "flat"


def answer_head(source: ModelSource, yes: int, no: int) -> ScoreHead:
    """A causal reranker's yes/no recipe as a head on the final hidden state (after the model's last
    norm, as the engine pools it): (lm_head[yes] - lm_head[no]) . h is logit(yes) - logit(no). One
    pooled request per pair, whose prompt prefix the cache can hold, instead of scoring the prompt
    followed by each answer at every position."""
    yes_row, no_row = _gguf_rows(source.gguf_file, [yes, no]) if source.gguf_file else _checkpoint_rows(
        source.model_dir, [yes, no])
    return ScoreHead(yes_row - no_row, 0.0, sigmoid=True)


def _checkpoint_rows(model_dir: Path, rows: list[int]) -> list[np.ndarray]:
    """LM-head rows from safetensors: `lm_head.weight`, or the embedding a tied head reads."""
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():
                    matrix = handle.get_slice(name)
                    return [matrix[row : row + 1].float().numpy()[0] for row in rows]
    raise ValueError(f"{model_dir}: no `lm_head.weight` or `model.embed_tokens.weight` tensor")


def _gguf_rows(path: Path, rows: list[int]) -> list[np.ndarray]:
    """LM-head rows of a GGUF file (`output.weight`, or the tied `token_embd.weight`), dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensors = check_gguf(path).tensors
    info = tensors.get("output.weight") or tensors["token_embd.weight"]
    row_bytes = info.n_bytes // info.dims[0]
    out = []
    with open(path, "rb") as file:
        for row in rows:
            file.seek(info.offset + row * row_bytes)
            raw = np.frombuffer(file.read(row_bytes), dtype=np.uint8)
            out.append(dequantize(raw, GGMLQuantizationType(info.qtype)).astype(np.float32).reshape(-1))
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
