"""The transformers backend (--model-impl transformers): a causal LM we have no native code for, run by
transformers' own modeling code inside our engine.

transformers computes everything but attention: its attention modules call the function registered
here under "crane_paged", which writes the layer's keys and values into our paged KV cache and attends
with our paged attention (sliding windows and logit soft-capping as the module passes them). The step's
tokens go in as one flattened row with their positions, so the scheduler, continuous batching, prefix
cache, preemption and sampler are the native models'. With no mask function registered for this
implementation, transformers builds no mask: the paged metadata is the mask.
"""

from __future__ import annotations

import copy
from typing import Iterable, Iterator

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.cache.attention import paged_attention
from crane_mp.worker.models.checkpoint import fill
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context

ATTENTION_NAME = "crane_paged"


def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature: query [1, H, T, D], key/value [1, KH, T, D];
    returns ([1, T, H, D], no weights). `s_aux`: gpt-oss's attention sinks."""
    _, num_heads, num_tokens, head_dim = query.shape
    scale = scaling if scaling is not None else head_dim**-0.5
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          module.k_cache, module.v_cache, get_forward_context().attn_of(module), scale, sliding_window,
                          softcap or None, s_aux)
    return out.view(1, num_tokens, num_heads, head_dim), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention)


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)


class TransformersCausalLM(nn.Module):
    """transformers' *ForCausalLM for `config.hf_config`, on our paged KV cache. Built on the platform's
    device with initialisation skipped (rope buffers are computed at construction, which a meta-device
    model would lose); the loader fills every parameter."""

    packs_linears = False  # transformers' modules call their linears on [1, T, hidden] rows

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        _register()
        self.config = config
        with torch.device(platform.device), no_init_weights():
            self.hf = AutoModelForCausalLM.from_config(config.hf_config, attn_implementation=ATTENTION_NAME,
                                                       dtype=torch.get_default_dtype())
        self.hf.tie_weights()  # what from_pretrained would do: a tied head shares the embedding's tensor
        self._attention = [m for m in self.hf.modules() if _is_attention(m)]
        if len(self._attention) != config.num_hidden_layers:
            raise ValueError(f"{type(self.hf).__name__}: found {len(self._attention)} attention modules for "
                             f"{config.num_hidden_layers} layers; the transformers backend serves models whose "
                             "every layer is one attention module")
        for module in self._attention:
            module.k_cache = module.v_cache = None  # bound by the runner
            module.head_dim = getattr(module, "head_dim", config.head_dim)
            k_proj = getattr(module, "k_proj", None)
            groups = getattr(module, "num_key_value_groups", None)  # also on a layer reading another's KV
            if isinstance(k_proj, nn.Linear):
                module.num_kv_heads = k_proj.out_features // module.head_dim
            else:
                module.num_kv_heads = config.num_attention_heads // groups if groups else config.num_key_value_heads
        hf_config = config.hf_config
        # What transformers' *ForCausalLM.forward does to the head's logits (which we compute ourselves).
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.logit_multiplier = float(getattr(hf_config, "logit_scale", None) or 1.0) / float(
            getattr(hf_config, "logits_scaling", None) or 1.0)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def logits_size(self) -> int:
        return self.config.vocab_size

    def tie_weights(self) -> None:
        """Tied at construction (on a real device, which materialising leaves as it is)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> the final hidden states [T, hidden] (transformers' final norm applied)."""
        positions = get_forward_context().positions
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        if self.final_softcap:  # in float32: tanh flattens 16-bit logits into ties
            logits = torch.tanh(logits.float() / self.final_softcap) * self.final_softcap
        return logits

    def attention_layers(self) -> list[nn.Module]:
        return self._attention

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Persistent buffers are checkpoint tensors too (Gemma 4's per-layer scalars).
        params = dict(self.hf.named_buffers()) | dict(self.hf.named_parameters())
        tied = self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight
        loaded: set[str] = set()
        for name, tensor in _in_memory_names(self.hf, weights):
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            fill(params[name].data, tensor, name)
            loaded.add(name)
        return loaded

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.hf.named_parameters()}


def _in_memory_names(hf: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as transformers' model holds them: transformers 5 converts some as it
    loads them (a layer's experts, one tensor each in the checkpoint, stacked into one) and renames
    others, by the model's conversion mapping; tensors a conversion takes wait for the rest of theirs."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # 4.x loads checkpoints under their own names
        yield from weights
        return
    # A prefix change needs the loader's view of which prefix the checkpoint has: ours are the model's.
    transforms = [t for t in get_model_conversion_mapping(hf) if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    pending: dict[str, WeightConverter] = {}
    for name, tensor in weights:
        renamed, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            yield renamed, tensor
            continue
        pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern])).add_tensor(renamed, name, pattern, tensor)
    for first_name, converter in pending.items():
        for name, tensor in converter.convert(first_name, model=hf, config=hf.config).items():
            yield name, tensor[0] if isinstance(tensor, list) else tensor
