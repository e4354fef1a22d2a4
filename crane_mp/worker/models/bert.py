"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): the checkpoints behind most sentence-transformers
embedding models and CrossEncoder rerankers, served for pooling only (--task embed, --task score).

Every prompt attends to all of itself, so the scheduler runs it whole in one step (SchedulerConfig
whole_prompts) and no KV cache is kept: attention reads the step's own keys, one sequence at a time.
Names follow transformers' checkpoints, so loading is a rename-free copy; a pooler and classifier
(a CrossEncoder's head) are left to the frontend (score_head.py), an MLM head is skipped.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.checkpoint import copy_named
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# Checkpoint tensors an encoder's own forward does not read: its pooler and classification head (the
# frontend's), an MLM head, position-id buffers.
_NOT_OURS = ("pooler.", "classifier.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
_PREFIXES = ("bert.", "roberta.", "model.")


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + config.first_position,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(getattr(hf, "type_vocab_size", 1) or 1, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)


class Dense(nn.Module):
    """transformers' `*Output`: a projection, then LayerNorm over the residual sum."""

    def __init__(self, inputs: int, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = Dense(config.hidden_size, config)


class Intermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.act = ACTIVATIONS[config.hidden_act]
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = Dense(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        attn = self.attention.self
        q, k, v = (proj(x).view(-1, self.heads, self.head_dim).transpose(0, 1) for proj in (attn.query, attn.key,
                                                                                            attn.value))
        mixed = torch.cat([
            F.scaled_dot_product_attention(q[:, start:end], k[:, start:end], v[:, start:end])
            for start, end in _bounds(lengths)
        ], dim=1).transpose(0, 1).reshape(x.shape)
        x = self.attention.output(mixed, x)
        return self.output(self.act(self.intermediate.dense(x)), x)


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))


class EncoderBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.norm = nn.Identity()  # the runner's pooling applies the model's final norm: BERT's is in its layers

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        spans = get_forward_context().spans
        if any(span.ctx_before for span in spans):
            raise RuntimeError("an encoder runs each prompt whole in one step")
        lengths = [span.q_len for span in spans]
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths]) + self.config.first_position
        emb = self.embeddings
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
        x = x + emb.token_type_embeddings(self._token_types(input_ids, lengths))
        x = emb.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, lengths)
        return x

    def _token_types(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """1 after a sequence's first separator (a text pair's second text, as its tokenizer marks it)."""
        types = torch.zeros_like(input_ids)
        sep = self.config.sep_token_id
        if self.embeddings.token_type_embeddings.num_embeddings < 2 or sep is None:
            return types
        for start, end in _bounds(lengths):
            found = (input_ids[start:end] == sep).nonzero()
            if len(found):
                types[start + int(found[0]) + 1 : end] = 1
        return types


class BertEncoder(nn.Module):
    """The served model: the encoder's final hidden states, and a one-row stub head (an encoder has
    no vocabulary logits; nothing but /health_generate's one token reads them)."""

    logits_size = 1

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__()
        self.config = config
        self.model = EncoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, 1, bias=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.embeddings.word_embeddings.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list:
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = copy_named(dict(self.model.named_parameters()),
                            ((name, tensor) for name, tensor in map(_strip_prefixes, weights)
                             if not name.startswith(_NOT_OURS)))
        with torch.no_grad():
            self.lm_head.weight.zero_()
        return loaded | {"lm_head.weight"}

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()} | {"lm_head.weight"}


def _strip_prefixes(pair: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    name, tensor = pair
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    return name, tensor


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    return bounds
