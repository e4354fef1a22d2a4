"""A checkpoint's multi-token-prediction layer as a model of its own, for speculative decoding
(worker/speculative/mtp.py): DeepSeek-V3's and GLM-4.5's `model.layers.{num_hidden_layers}`.

Its row i reads token i + 1's embedding and the target's final hidden state at i (after the target's
final norm), each through a norm of its own, joined by `eh_proj`; then one decoder layer of the family,
with a KV cache of its own; then `shared_head.norm` and the target's LM head: a guess at token i + 2.
A guess further on feeds the layer's own output back as the hidden state. The embedding and the head
are the target's: the checkpoint's copies under the layer are the same tensors, and are not loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, make_norm
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context

_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.")
_SHARED_NORM = "shared_head.norm."
_TARGETS_COPIES = ("embed_tokens.", "shared_head.head.")  # served from the target's own tensors
_IGNORED = "target_copy."


def prediction_layers(config: ModelConfig) -> int:
    """The multi-token-prediction layers the checkpoint's config declares (0: none)."""
    return int(getattr(config.hf_config.get_text_config(), "num_nextn_predict_layers", 0) or 0) \
        if config.hf_config is not None else 0


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
        self._target = (target,)  # a tuple: the target's modules are not this model's parameters
        self.previous_hidden: torch.Tensor | None = None  # [T, hidden], set before each forward

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = get_forward_context().positions
        # A sequence's first row takes no embedding (DeepSeek's reference inference, as vLLM serves it).
        embeds = self._target[0].model.embed(input_ids).masked_fill((positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(self.previous_hidden)], dim=-1))
        x, residual = self.layers[0](x, None)
        return x if residual is None else x + residual


class NextTokenPredictor(CausalLM):
    """Put before a family's class (`next_token_model_class`): its load_weights, with its renames, fills
    the layer from the checkpoint's names under `model.layers.{num_hidden_layers}.`."""

    def __init__(self, config: ModelConfig, target: CausalLM, platform: Platform) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = _NextTokenDecoder(config, target, platform)
        self.vocab_parallel = False
        self.ignored_weights = (_IGNORED,)
        self.layer_prefix = f"model.layers.{config.num_hidden_layers}."
        self._target = (target,)

    @property
    def logits_size(self) -> int:
        return self.config.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].head_logits(self.model.norm(hidden))

    def parameter_name(self, checkpoint_name: str) -> str:
        rest = checkpoint_name.removeprefix(self.layer_prefix)
        if rest == checkpoint_name:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} is not the prediction layer's")
        if rest.startswith(_TARGETS_COPIES):
            return _IGNORED + rest
        if rest.startswith(_OWN_PARTS):
            return super().parameter_name("model." + rest)
        if rest.startswith(_SHARED_NORM):
            return "model.norm." + rest.removeprefix(_SHARED_NORM)
        return super().parameter_name("model.layers.0." + rest)

    def in_layer(self, checkpoint_name: str) -> bool:
        return checkpoint_name.startswith(self.layer_prefix)


def next_token_model_class(family: type[CausalLM]) -> type[CausalLM]:
    """The prediction layer's model class for the target's family (its attention, layer and loading)."""
    return type(f"NextToken{family.__name__}", (NextTokenPredictor, family), {"skips_extra_layers": False})
