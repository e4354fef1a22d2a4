"""Worker start-up: load the model, measure memory, size and allocate the KV cache."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from crane_mp.config import EngineConfig, pools_outputs
from crane_mp.heap import reuse_freed_blocks
from crane_mp.models.config import ModelConfig, load_gguf_config, load_model_config
from crane_mp.models.gguf_file import ModelSource, check_gguf, describe_types, resolve_model_source
from crane_mp.models.kv_groups import sequence_blocks
from crane_mp.models.registry import ARCHITECTURES, TRANSFORMERS
from crane_mp.models.sharding import shard_config
from crane_mp.worker.cache.memory import KVPlan, plan_kv_blocks
from crane_mp.worker.parallel.tensor_parallel import TensorParallel
from crane_mp.worker.platforms import Platform, platform_for, select_platform
from crane_mp.worker.platforms.device import prefer_huge_pages
from crane_mp.worker.sampling.grammar import GrammarEngine
from crane_mp.worker.speculative.draft import DraftProposer
from crane_mp.worker.speculative.mtp import MtpProposer
from crane_mp.worker.speculative.setup import check_target, load_draft, load_prediction_layer, ngram_proposer
from crane_mp.worker.step.decode_graphs import graph_batch_sizes, static_buffer_bytes, table_width
from crane_mp.worker.step.runner import ModelRunner
from crane_mp.worker.weights.loader import file_tensor_bytes, load_model, weight_bytes
from crane_mp.worker.weights.lora import adapter_bytes, load_adapters
from crane_mp.worker.weights.offload import (
    GPU_RESERVE_BYTES,
    HostExperts,
    describe,
    expert_bytes_by_layer,
    host_expert_layers,
)

log = logging.getLogger(__name__)

# The CPU warm-up step (its memory is estimated, not measured): only to run every code path once
# (kernel libraries, thread pools, first allocations), so it is tiny: at 8B a token costs ~0.1 s.
_CPU_WARMUP_TOKENS = 4
_CPU_WARMUP_SEQS = 2
# Allocator rounding and per-graph bookkeeping in the decode graphs' pool, and cuBLAS's workspace for
# the capture stream (32 MiB on Hopper).
_GRAPH_POOL_SLACK = 64 << 20


@dataclass(slots=True)
class LoadedWorker:
    runner: ModelRunner
    model_config: ModelConfig
    kv_plan: KVPlan
    platform: Platform
    dtype: torch.dtype
    max_model_len: int
    model_format: str
    weight_types: str
    weights_file_bytes: int
    quantized_activations: str  # "int8" or "float" for GGUF weights (an MXFP4 checkpoint's experts), "n/a" otherwise
    prefill_seconds_per_token: float  # CPU: the warm-up step's time per token; 0 on CUDA

    @property
    def device(self) -> torch.device:
        return self.platform.device


def _check_transformers_backend(config: EngineConfig, tp: TensorParallel | None) -> None:
    """What the transformers backend does not serve, refused at start rather than at the first request."""
    if tp is not None:
        raise ValueError("the transformers backend runs on one device: --tensor-parallel-size 1, or a model "
                         "with a native implementation")
    if pools_outputs(config.task):
        raise ValueError(f"--task {config.task} needs a native implementation; the transformers backend "
                         "serves --task generate")
    if config.lora:
        raise ValueError("LoRA adapters need a native implementation; the transformers backend serves the base "
                         "model only")


def model_dtype(platform: Platform, requested: str, model_config: ModelConfig) -> torch.dtype:
    """The compute dtype: the platform's choice, but never an automatic float16 for a model whose
    activations overflow it (Gemma): float32 there, which every device computes exactly."""
    dtype = platform.compute_dtype(requested, model_config.torch_dtype)
    if dtype != torch.float16 or not ARCHITECTURES[model_config.arch].overflows_float16:
        return dtype
    if requested == "auto":
        log.info("%s overflows float16 and this device has no bf16: computing in float32", model_config.arch)
        return torch.float32
    log.warning("--dtype float16: %s's activations overflow float16 (inf/NaN logits are likely); "
                "bfloat16 or float32 is safe", model_config.arch)
    return dtype


def graph_pool_bytes(runner: ModelRunner, sizes: list[int], cfg: ModelConfig) -> int:
    """Memory the decode graphs will hold: the measured peak of an eager decode step of the largest
    bucket (graphs of smaller buckets reuse it in their pool), every graph's output, which stays
    allocated, and their static input buffers."""
    peak = runner.platform.measure_activation_bytes(lambda _: runner.profile_decode(sizes[-1]), 0)
    outputs = sum(sizes) * cfg.hidden_size * runner.dtype.itemsize
    inputs = static_buffer_bytes(sizes[-1], table_width(runner.max_positions, runner.block_size),
                                 len(runner.kv_groups.windows))
    return int(1.25 * peak) + outputs + inputs + _GRAPH_POOL_SLACK


class PhaseTimer:
    """Seconds spent in each start-up phase, for the one log line that says where start-up went."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._mark = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.phases.append((name, now - self._mark))
        self._mark = now

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)


def _host_experts(config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                  platform: Platform) -> HostExperts | None:
    """On a GPU, the GGUF mixture-of-experts layers whose experts stay in host memory: --cpu-moe-layers, or
    as many as leave the rest of the file within the memory limit beside room for the runtime, a step's
    activations and the KV cache's first sequences."""
    if platform.on_cpu or model_config.layout.experts is None:
        return None
    if source.format != "gguf":
        if config.cpu_moe_layers:
            raise ValueError("--cpu-moe-layers keeps a GGUF file's experts in host memory; this model is a "
                             "safetensors checkpoint")
        return None
    contents = check_gguf(source.gguf_file)
    by_layer = expert_bytes_by_layer(contents)
    limit = (config.memory_limit or platform.default_memory_limit).resolve(platform.total_memory())
    budget = limit - GPU_RESERVE_BYTES - config.max_num_batched_tokens * model_config.activation_bytes_per_token
    layers = host_expert_layers(config.cpu_moe_layers, by_layer, contents.tensor_bytes, budget)
    log.info("mixture of experts: %s", describe(layers, by_layer))
    if not layers:
        return None
    cpu = platform_for("cpu")
    return HostExperts(frozenset(layers), cpu, cpu.int8_matmuls(config.quantized_activations))


def load_worker(config: EngineConfig, progress: bool = True, timer: PhaseTimer | None = None,
                tp: TensorParallel | None = None) -> LoadedWorker:
    """`tp`: this process is one tensor-parallel rank; it loads its part of the model, and the ranks
    agree on one KV block count (the smallest any of them holds)."""
    timer = timer or PhaseTimer()
    prefer_huge_pages()
    reuse_freed_blocks()
    torch.manual_seed(config.seed)
    source = resolve_model_source(config.model_path, config.model_format)
    if source.format == "gguf":
        if config.model_impl == "transformers":
            raise ValueError("--model-impl transformers serves safetensors checkpoints, not GGUF files")
        model_config = load_gguf_config(source.gguf_file, config.model_type)
    else:
        model_config = load_model_config(source.model_dir, config.model_type, config.model_impl)
    timer.done("config")
    # The model this process holds: the whole of it, or a rank's part (heads, units, vocabulary rows).
    if model_config.arch == TRANSFORMERS:
        _check_transformers_backend(config, tp)
    elif config.lora and (model_config.layout.varies_by_layer or model_config.layout.experts is not None
                          or model_config.layout.linear is not None):
        shapes = ("layers of different shapes" if model_config.layout.varies_by_layer
                  else "linear-attention layers" if model_config.layout.linear is not None
                  else "mixture-of-experts layers")
        raise ValueError(f"LoRA adapters for {model_config.arch} ({shapes}) are not supported "
                         "yet; the base model is served without --enable-lora")
    rank_config = model_config if tp is None else shard_config(model_config, tp.rank, tp.size)
    # Builds or loads the CPU kernels: reported on their own.
    platform = select_platform(config.force_cpu, 0 if tp is None else tp.device.index or 0)
    timer.done("kernels")
    allocated_before = platform.allocated_bytes()  # others' tensors in this process (an in-process engine)
    dtype = model_dtype(platform, config.dtype, model_config)
    int8 = platform.int8_matmuls(config.quantized_activations)
    host_experts = _host_experts(config, model_config, source, platform)
    model, weight_types = load_model(rank_config, source, dtype, platform, progress, pools_outputs(config.task),
                                     lora=config.lora, int8_activations=int8, host_experts=host_experts,
                                     drop_file_pages=not config.keep_page_cache)
    if config.lora_modules:
        lora_bytes = load_adapters(model, config.lora_modules, config.max_lora_rank, dtype, platform)
        names = ", ".join(name for name, _ in config.lora_modules)
        log.info("LoRA adapters: %s (%.1f MiB)", names, lora_bytes / 2**20)
    timer.done("weights")
    tuned = platform.tune_linears(model, config.max_num_seqs)
    for line in tuned:
        log.info("decode matmul %s", line)
    if tuned:
        timer.done("decode matmuls")

    # An encoder's requests "sample" one placeholder token after a prompt that may fill every position.
    placeholder = 1 if model_config.encoder else 0
    max_model_len = config.max_model_len or model_config.max_position_embeddings + placeholder
    if config.max_total_tokens is not None:
        capacity = config.max_total_tokens // config.block_size * config.block_size
        if capacity < max_model_len:
            log.info("max_model_len lowered from %d to --max-total-tokens %d", max_model_len, capacity)
            max_model_len = capacity
    grammars = GrammarEngine(source, model_config.vocab_size, list(model_config.eos_token_ids), platform)
    runner = ModelRunner(model, config.block_size, max_model_len, platform, grammars=grammars,
                         kv_dtype=platform.kv_dtype(config.kv_cache_dtype, dtype,
                                                   pools_outputs(config.task) or model_config.media is not None),
                         share_tokens=None if tp is None else tp.first_rank_tokens,
                         recurrent_dtype=getattr(torch, config.mamba_ssm_cache_dtype))

    draft = None  # a draft model's or a prediction layer's runner
    if config.speculative_method is not None:
        check_target(config, model_config, runner)
        if config.speculative_method == "draft":
            draft = load_draft(config, runner, platform, dtype, progress)
            timer.done("draft model")
        elif config.speculative_method == "mtp":
            draft = load_prediction_layer(config, model_config, source, runner, platform, dtype, progress)
            timer.done("prediction layer")
    # What the device holds: a GPU's plan leaves out the experts kept in host memory.
    weights_bytes = weight_bytes(model, platform.device) + (weight_bytes(draft.model) if draft is not None else 0)
    draft_kv_bytes = draft.kv_bytes_per_token() if draft is not None else 0  # its cache holds the same blocks
    # What else this engine already holds for good (rope tables, grammar and sampler tensors).
    resident_bytes = max(0, platform.allocated_bytes() - allocated_before - weights_bytes)
    # The largest step: a full token budget of prompt, then sampling for every sequence at once with
    # every processor on (the [sequences, vocabulary] temporaries of top-p, penalties and logprobs).
    # An encoder's longest prompt leaves out its placeholder: its positions end there.
    profile_tokens = min(config.max_num_batched_tokens, max_model_len - placeholder)
    profile_seqs = min(config.max_num_seqs, profile_tokens)

    # A vision-language model's largest image: its tower's pass joins the measured peak (CUDA), its
    # estimate the CPU plan's.
    largest = (model.largest_image(Path(config.model_path), config.mm_processor_kwargs)
               if getattr(model, "media_kind", None) == "image" else None)

    def profile(full: bool) -> int:
        if full:
            return runner.profile_step(profile_tokens, profile_seqs, largest)
        return runner.profile_step(min(profile_tokens, _CPU_WARMUP_TOKENS), min(profile_seqs, _CPU_WARMUP_SEQS))

    kernel_cache_bytes, kernel_caches = platform.warm_kernel_caches(
        model, max(config.max_num_batched_tokens, config.max_num_seqs))
    if kernel_caches:
        log.info("%s: %.1f MiB, in the memory plan's reserved", kernel_caches, kernel_cache_bytes / 2**20)
    estimate = (profile_tokens * rank_config.activation_bytes_per_token
                + runner.sampler.peak_bytes(profile_seqs))
    if largest is not None:
        vision_bytes = model.vision_activation_bytes(largest)
        log.info("largest image: %d x %d patches, %.1f MiB of vision activations in the plan", largest[1],
                 largest[2], vision_bytes / 2**20)
        estimate = max(estimate, vision_bytes)  # the tower runs, and frees, before the language model
    warm_up_started = time.monotonic()
    activation_bytes = platform.measure_activation_bytes(profile, estimate)
    # The scheduler's first estimate of a prompt token's cost (scheduler/pacing.py); CUDA is not paced.
    seconds_per_token = (time.monotonic() - warm_up_started) / min(profile_tokens, _CPU_WARMUP_TOKENS)
    timer.done("warm-up")
    # Not with tensor parallelism yet: a captured step would replay its collectives too, untested. Not
    # for a media model: its steps read per-request state (rope positions, a window's cross-attention).
    # Not for experts: a prompt's step groups its rows by expert on the host (decode steps' grouped
    # matmuls read nothing on the host, but have not been captured on a GPU yet). Not for recurrent
    # layers: a step reads its sequences' state slots.
    graphs = (platform.cuda_graphs(config.cuda_graphs, runner.attention_backend) and not model_config.encoder
              and model_config.media is None and tp is None and model_config.arch != TRANSFORMERS
              and model_config.layout.experts is None and not runner.state_layers)
    graph_sizes = graph_batch_sizes(config.max_num_seqs) if graphs else []
    reserved_bytes = kernel_cache_bytes + (graph_pool_bytes(runner, graph_sizes, rank_config) if graphs else 0)
    if config.runtime_lora:  # room for the adapters /v1/load_lora_adapter may still load, each at the largest rank
        reserved_bytes += (config.max_loras - len(config.lora_modules)) * adapter_bytes(
            rank_config, config.max_lora_rank, platform.lora_dtype(dtype))
    total_bytes = platform.total_memory()
    if tp is not None and platform.on_cpu:  # the ranks on one host share its memory
        total_bytes //= tp.parallel.ranks_per_node
    kv_plan = plan_kv_blocks(
        limit=config.memory_limit or platform.default_memory_limit,
        total_bytes=total_bytes,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        kv_bytes_per_token=runner.kv_bytes_per_token() + draft_kv_bytes,
        block_size=config.block_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_total_tokens=config.max_total_tokens,
        reserved_bytes=reserved_bytes,
        free_bytes=platform.free_memory(),
        resident_bytes=resident_bytes,
        runtime_bytes=platform.runtime_bytes(activation_bytes),
        fit_model_len=not config.max_model_len,
        sequence_blocks=lambda num_tokens: sequence_blocks(runner.kv_groups.windows, num_tokens, config.block_size,
                                                           config.max_num_batched_tokens),
        kv_bytes_per_long_token=runner.kv_bytes_per_long_token() + draft_kv_bytes,
        state_bytes_per_seq=runner.state_bytes_per_sequence(),
    )
    if tp is not None:
        num_blocks, fitted_len = tp.agree_min([kv_plan.num_blocks, kv_plan.max_model_len])
        if (num_blocks, fitted_len) != (kv_plan.num_blocks, kv_plan.max_model_len):
            log.info("rank %d holds the %d KV blocks of the smallest rank's plan", tp.rank, num_blocks)
        kv_plan = dataclasses.replace(kv_plan, num_blocks=num_blocks, max_model_len=fitted_len,
                                      kv_budget_bytes=num_blocks * config.block_size * kv_plan.kv_bytes_per_token)
    log.info("memory plan: %s", kv_plan.describe())
    if kv_plan.max_model_len < max_model_len:
        log.warning("max_model_len lowered from the model's %d to %d tokens, what the memory plan holds for one "
                    "sequence; --max-seq-len sets it (lower: more concurrent sequences; higher: raise "
                    "--gpu-memory-limit)", max_model_len, kv_plan.max_model_len)
        max_model_len = runner.max_positions = kv_plan.max_model_len
    runner.allocate_kv_cache(kv_plan.num_blocks)
    if draft is not None:
        draft.allocate_kv_cache(kv_plan.num_blocks)
        runner.proposer = (MtpProposer(draft, model.model.norm) if config.speculative_method == "mtp"
                           else DraftProposer(draft, config.max_num_batched_tokens))
    elif config.speculative_method == "ngram":
        runner.proposer = ngram_proposer(config)
    if runner.state_layers:
        runner.allocate_state_pool(kv_plan.state_slots)
        if kv_plan.state_slots < config.max_num_seqs:
            log.info("at most %d sequences run at once: the memory plan holds recurrent state for that many "
                     "(--max-num-seqs %d)", kv_plan.state_slots, config.max_num_seqs)
    timer.done("kv cache")
    if graphs:
        runner.enable_decode_graphs(graph_sizes)
        timer.done("cuda graphs")
    return LoadedWorker(
        runner, model_config, kv_plan, platform, dtype, max_model_len, source.format, describe_types(weight_types),
        file_tensor_bytes(source), ("int8" if int8 else "float") if source.format == "gguf" or weight_types else "n/a",
        seconds_per_token if platform.on_cpu else 0.0,
    )
