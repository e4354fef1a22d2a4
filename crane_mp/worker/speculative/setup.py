"""Speculative decoding at worker start-up: what it refuses, and the proposer it builds (a draft model's
or a prediction layer's runner)."""

from __future__ import annotations

import logging

import torch

from crane_mp.config import EngineConfig
from crane_mp.models.config import ModelConfig, load_gguf_config, load_model_config
from crane_mp.models.gguf_file import ModelSource, resolve_model_source
from crane_mp.models.registry import TRANSFORMERS
from crane_mp.worker.models.build import materialize, on_meta
from crane_mp.worker.models.nextn import next_token_model_class
from crane_mp.worker.platforms import Platform
from crane_mp.worker.quantized.gguf_loader import load_gguf_prediction_layer
from crane_mp.worker.speculative.ngram import NgramProposer
from crane_mp.worker.step.runner import ModelRunner
from crane_mp.worker.weights.cpu_packing import pack_linear_weights
from crane_mp.worker.weights.loader import iter_safetensors, load_model, safetensors_files, weight_bytes

log = logging.getLogger(__name__)


def check_target(config: EngineConfig, model_config: ModelConfig, runner: ModelRunner) -> None:
    """Refuse, at start, a target whose steps cannot verify proposals: a rejected proposal must leave
    nothing behind but KV that later tokens overwrite (a hybrid's recurrent layers keep the state of
    the rows kept: ModelRunner._commit_states)."""
    if model_config.media is not None:
        raise ValueError(f"speculative decoding serves text models; {model_config.arch} takes "
                         f"{model_config.media} input")
    if config.speculative_method in ("draft", "mtp") and len(runner.kv_groups.windows) > 1:
        raise ValueError(f"a draft model shares the target's block tables; {model_config.arch}'s sliding-window "
                         "layers keep tables of their own: use --speculative-method ngram")


def load_draft(config: EngineConfig, target: ModelRunner, platform: Platform, dtype: torch.dtype,
               progress: bool) -> ModelRunner:
    """The draft model's runner (its KV cache not allocated yet), refused unless it proposes tokens the
    target can take: the same tokenizer's ids, one KV group, no recurrent or media state."""
    source = resolve_model_source(config.speculative_model, "auto")
    if source.format == "gguf":
        draft_config = load_gguf_config(source.gguf_file, "auto")
    else:
        draft_config = load_model_config(source.model_dir, "auto", "native")
    name = config.speculative_model
    if draft_config.arch == TRANSFORMERS or draft_config.encoder or draft_config.media is not None:
        raise ValueError(f"the draft model {name} must be a text decoder crane-mp implements natively")
    if draft_config.vocab_size > target.config.vocab_size:
        raise ValueError(f"the draft model {name} has {draft_config.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}: it must share the target's tokenizer")
    model, _ = load_model(draft_config, source, dtype, platform, progress,
                          int8_activations=platform.int8_matmuls(config.quantized_activations),
                          drop_file_pages=not config.keep_page_cache)
    platform.tune_linears(model, config.max_num_seqs)
    runner = ModelRunner(model, config.block_size, target.max_positions, platform, kv_dtype=target.kv_dtype)
    if runner.state_layers or len(runner.kv_groups.windows) > 1:
        raise ValueError(f"the draft model {name} must use full attention in every layer (no sliding windows or "
                         "linear attention)")
    log.info("draft model %s: %s, %.1f MiB of weights, %d KV bytes per token", name, draft_config.arch,
             weight_bytes(model) / 2**20, runner.kv_bytes_per_token())
    return runner


def load_prediction_layer(config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                          target: ModelRunner, platform: Platform, dtype: torch.dtype, progress: bool) -> ModelRunner:
    """The runner of the checkpoint's multi-token-prediction layer (its KV cache not allocated yet),
    refused, with what to do instead, where the checkpoint has none crane-mp serves."""
    family = type(target.model)
    refused = (f"--speculative-method mtp: this {model_config.arch} checkpoint has no multi-token-prediction layer "
               "crane-mp serves (DeepSeek-V3's, GLM-4.5's, Qwen3.5's, Qwen3-Next's); use ngram, or draft with "
               "--speculative-model")
    if family.prediction_layer is None:
        raise ValueError(refused)
    model = on_meta(lambda: next_token_model_class(family)(model_config, target.model, platform), dtype)
    if source.format == "gguf":
        loaded = load_gguf_prediction_layer(model, source.gguf_file, dtype, platform, progress,
                                            platform.int8_matmuls(config.quantized_activations),
                                            not config.keep_page_cache)
    else:
        materialize(model, platform.device)
        loaded = model.load_weights(iter_safetensors(safetensors_files(source.model_dir), progress, model.in_layer))
    if not loaded:
        raise ValueError(refused)
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"--speculative-method mtp: the checkpoint lacks {len(missing)} tensors of its multi-token-"
                         f"prediction layer ({model.prefixes[0]}*), e.g. {sorted(missing)[:3]}")
    model.eval()
    if platform.pack_bf16_weights(dtype):
        pack_linear_weights(model, spare=False)
    platform.tune_linears(model, config.max_num_seqs)
    runner = ModelRunner(model, config.block_size, target.max_positions, platform, kv_dtype=target.kv_dtype)
    log.info("multi-token prediction: layer %d, %.1f MiB of weights, %d KV bytes per token",
             model_config.num_hidden_layers, weight_bytes(model) / 2**20, runner.kv_bytes_per_token())
    return runner


def ngram_proposer(config: EngineConfig) -> NgramProposer:
    return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
