"""What a model not yet loaded will hold, from its config and files alone (no torch): the router's
first guess, before the model's own processes are measured (manager.py). An upper bound in the usual
case: the KV cache as its memory plan would size it at most, attention layers all full."""

from __future__ import annotations

from crane_mp.config import EngineConfig
from crane_mp.models.config import ModelConfig, load_gguf_config, load_model_config
from crane_mp.models.gguf_file import check_gguf, resolve_model_source

_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_bytes(engine: EngineConfig, host_bytes: int) -> int:
    """Weights, KV cache and activations of `engine`'s model (bytes)."""
    source = resolve_model_source(engine.model_path, engine.model_format)
    if source.format == "gguf":
        config = load_gguf_config(source.gguf_file, engine.model_type)
        weights = check_gguf(source.gguf_file).tensor_bytes
    else:
        config = load_model_config(source.model_dir, engine.model_type, engine.model_impl)
        weights = sum(path.stat().st_size for path in source.model_dir.glob("*.safetensors"))
        stored = _FLOAT_BYTES.get(str(config.torch_dtype).removeprefix("torch."), 2)
        weights = weights * _FLOAT_BYTES.get(engine.dtype, stored) // stored
    kv = _kv_bytes(engine, config, weights, host_bytes)
    return weights + kv + _activation_bytes(engine, config)


def _kv_bytes(engine: EngineConfig, config: ModelConfig, weights: int, host_bytes: int) -> int:
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    per_token *= _FLOAT_BYTES.get(engine.kv_cache_dtype, 2)
    max_model_len = engine.max_model_len or config.max_position_embeddings
    tokens = engine.max_total_tokens or engine.max_num_seqs * max_model_len
    cap = (engine.memory_limit.resolve(host_bytes) - weights if engine.memory_limit is not None
           else host_bytes // 4)  # the memory plan's own caps (worker/cache/memory.py)
    return max(0, min(per_token * tokens, cap))


def _activation_bytes(engine: EngineConfig, config: ModelConfig) -> int:
    """The widest layer's float32 temporaries over a full step's tokens, and the sampler's rows."""
    return (engine.max_num_batched_tokens * config.activation_bytes_per_token
            + 4 * 3 * engine.max_num_seqs * config.vocab_size)
