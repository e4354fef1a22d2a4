"""A checkpoint's multi-token-prediction layer as a model of its own, for speculative decoding
(worker/speculative/mtp.py): DeepSeek-V3's and GLM-4.5's `model.layers.{num_hidden_layers}.*`, and
Qwen3.5's and Qwen3-Next's `mtp.*`.

Its row i reads token i + 1's embedding and the target's final hidden state at i (after the target's
final norm), each through a norm of its own, joined by a projection; then one decoder layer of the
family (full attention, with a KV cache of its own); then a norm of its own and the target's LM head:
a guess at token i + 2. A guess further on feeds the layer's own output back as the hidden state:
DeepSeek's before that last norm, Qwen's after it (as vLLM and SGLang serve them). The embedding and
the head are the target's: the copies DeepSeek-V3 keeps under the layer are the same tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.models.layouts import FULL
from crane_mp.models.registry import hf_name
from crane_mp.worker.models.layers import CausalLM, make_norm
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context


@dataclass(frozen=True)
class PredictionLayout:
    """How a family's checkpoint keeps its prediction layer."""

    parts: dict[str, str]  # the checkpoint's names of the layer's own parts -> ours
    copies: tuple[str, ...] = ()  # the target's tensors the checkpoint repeats under the layer (not loaded)
    masks_first: bool = False  # a sequence's first row takes no embedding
    carries_normed: bool = False  # a further guess reads the layer's output after its last norm


LAYOUTS = {
    # DeepSeek-V3, GLM-4.5: model.layers.{num_hidden_layers}.*, the reference inference's first-row mask.
    "nextn": PredictionLayout({"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "norm"},
                              copies=("embed_tokens.", "shared_head.head."), masks_first=True),
    # Qwen3.5, Qwen3-Next: mtp.*.
    "mtp": PredictionLayout({"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj",
                             "norm": "norm"}, carries_normed=True),
}


# llama.cpp's names of a prediction layer's own parts (`blk.{n}.nextn.*`) -> ours.
_GGUF_PARTS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head_norm": "norm"}


# Where Qwen3.5's and Qwen3-Next's checkpoints keep the layer (the vision-language ones under model.).
MTP_PREFIXES = ("mtp.", "model.mtp.")


def layer_prefixes(target: CausalLM) -> tuple[str, ...]:
    """Where the target's checkpoint names its prediction layer's tensors."""
    if target.prediction_layer == "mtp":
        return MTP_PREFIXES
    return (f"model.layers.{target.config.num_hidden_layers}.",)


class _NextTokenDecoder(nn.Module):
    def __init__(self, config: ModelConfig, target: CausalLM, platform: Platform) -> None:
        super().__init__()
        family, index, size = type(target), config.num_hidden_layers, config.hidden_size
        self.enorm = make_norm(size, config.rms_norm_eps, config.layout.norm, platform.elementwise)
        self.hnorm = make_norm(size, config.rms_norm_eps, config.layout.norm, platform.elementwise)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.layers = nn.ModuleList([family.decoder_class.layer_class(
            config, family.attention_class(config, platform, index), platform.elementwise, family.norm_names, index)])
        self.norm = make_norm(size, config.rms_norm_eps, config.layout.norm, platform.elementwise)
        self.masks_first = LAYOUTS[target.prediction_layer].masks_first
        self._target = (target,)  # a tuple: the target's modules are not this model's parameters
        self.previous_hidden: torch.Tensor | None = None  # [T, hidden], set before each forward

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self._target[0].model.embed(input_ids)
        if self.masks_first:
            embeds = embeds.masked_fill((get_forward_context().positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(self.previous_hidden)], dim=-1))
        x, residual = self.layers[0](x, None)
        return x if residual is None else x + residual


class NextTokenPredictor(CausalLM):
    """Put before a family's class (`next_token_model_class`): the family's load_weights, with its
    renames, fills the layer from the checkpoint's names (LAYOUTS)."""

    def __init__(self, config: ModelConfig, target: CausalLM, platform: Platform) -> None:
        nn.Module.__init__(self)
        index = config.num_hidden_layers
        if config.layout.layer_types:  # the layer past the last: full attention
            config = dataclasses.replace(config, layout=dataclasses.replace(
                config.layout, layer_types=(*config.layout.layer_types[:index], FULL)))
        self.config = config
        self.model = _NextTokenDecoder(config, target, platform)
        self.vocab_parallel = False
        self.layout = LAYOUTS[target.prediction_layer]
        self.prefixes = layer_prefixes(target)
        self._target = (target,)

    @property
    def logits_size(self) -> int:
        return self.config.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].head_logits(self.model.norm(hidden))

    def carried(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a further guess reads as the hidden state, from this layer's output rows."""
        return self.model.norm(hidden) if self.layout.carries_normed else hidden

    def gguf_checkpoint_name(self, gguf_name: str) -> str | None:
        """The checkpoint name of a GGUF tensor of the layer's block, as llama.cpp's converter writes it
        for every family (the decoder layer's usual names, the rest under `nextn.`); None for its
        copies of the target's token table and head."""
        index = self.config.num_hidden_layers
        stem, _, kind = gguf_name.rpartition(".")
        part = stem.removeprefix(f"blk.{index}.nextn.")
        if part != stem:
            ours = _GGUF_PARTS.get(part)
            names = {mine: theirs for theirs, mine in self.layout.parts.items()}
            return None if ours is None else f"{self.prefixes[0]}{names[ours]}.{kind}"
        rest = hf_name(gguf_name, self.config.arch).removeprefix(f"model.layers.{index}.")
        return self.prefixes[0] + ("layers.0." if self.prefixes[0] == "mtp." else "") + rest

    def in_layer(self, checkpoint_name: str) -> bool:
        return checkpoint_name.startswith(self.prefixes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._layer_weights(weights))

    def _layer_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The layer's tensors under the names a one-layer model of the family has."""
        for name, tensor in weights:
            prefix = next((p for p in self.prefixes if name.startswith(p)), None)
            if prefix is None:
                raise KeyError(f"checkpoint tensor {name!r} is not the prediction layer's")
            rest = name[len(prefix):]
            if rest.startswith(self.layout.copies):
                continue
            part = next((p for p in self.layout.parts if rest.startswith(p + ".")), None)
            if part is not None:
                yield f"model.{self.layout.parts[part]}{rest[len(part):]}", tensor
            else:
                yield "model." + (rest if rest.startswith("layers.0.") else "layers.0." + rest), tensor


def next_token_model_class(family: type[CausalLM]) -> type[CausalLM]:
    """The prediction layer's model class for the target's family (its attention, layer and loading)."""
    return type(f"NextToken{family.__name__}", (NextTokenPredictor, family), {"skips_extra_layers": False})
