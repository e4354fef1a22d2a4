"""Frozen engine configuration, the parsing of user-facing values (memory limits, dtypes), and the
environment variables crane-mp reads.

No torch here: the scheduler and frontend import this module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from crane_mp.logs import LogSettings
from crane_mp.models.pooling import Pooling
from crane_mp.parallel import ParallelConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16", "float16")  # a hybrid model's recurrent state (vLLM's mamba_ssm_cache_dtype)
# How CPU matmuls on GGUF-quantized weights treat activations: int8 blocks with integer dot products
# (llama.cpp's scheme, the default), or float (exact; what the transformers comparisons use).
QUANTIZED_ACTIVATIONS = ("int8", "float")
LOG_FORMATS = ("text", "json")
# frontend/tools/formats.py
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "granite", "gemma4", "openai", "none")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "seed_oss", "gemma4", "gpt_oss", "openai_gptoss",
                     "none")  # frontend/serving/reasoning.py
TASKS = ("auto", "generate", "embed", "score", "transcribe")
# CPU instruction-set tiers, lowest first; each includes the ones before it (worker/kernels/cpu_isa.py).
CPU_ISAS = ("avx2", "avx512", "avx512_bf16", "amx")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# Audio samples (frames x channels) an upload may hold per second of --max-audio-seconds, unless
# --max-audio-samples says otherwise: 48 kHz stereo, six times the 16 kHz mono Whisper takes, so that
# studio recordings of the longest allowed duration still decode (4 bytes per sample while decoding).
AUDIO_SAMPLES_PER_SECOND = 48000 * 2


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """Either an absolute byte count or a fraction of the device's memory."""

    num_bytes: int | None = None
    fraction: float | None = None

    def resolve(self, total_bytes: int) -> int:
        if self.num_bytes is not None:
            return self.num_bytes
        return int(self.fraction * total_bytes)


def parse_memory_limit(text: str) -> MemoryLimit:
    """'8G', '5120M', '512MiB', '1.5GB' -> bytes; '0.75' -> 75% of device memory."""
    value = text.strip().upper()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?", value)
    if not match:
        raise ValueError(f"invalid memory limit {text!r}: use e.g. 8G, 5120M or a fraction like 0.75")
    number, unit, suffix = float(match.group(1)), match.group(2), match.group(3)
    if not unit and not suffix:
        if 0 < number <= 1:
            return MemoryLimit(fraction=number)
        raise ValueError(f"invalid memory limit {text!r}: a bare number must be a fraction in (0, 1]; add a unit")
    if number <= 0:
        raise ValueError(f"invalid memory limit {text!r}: must be positive")
    return MemoryLimit(num_bytes=int(number * _UNITS[unit]))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the worker and scheduler need to start; built once from CLI flags (or by library callers)."""

    model_path: str
    model_type: str = "auto"
    model_impl: str = "auto"  # native, transformers (its modeling code on our engine), or auto: native if we have it
    model_format: str = "auto"  # auto | safetensors | gguf (gguf_file.resolve_model_source)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: 16-bit on CPU, the compute dtype on CUDA (worker/platforms/)
    # Linear-attention layers' recurrent state (worker/cache/state_pool.py); their convolution state is
    # kept in the compute dtype.
    mamba_ssm_cache_dtype: str = "float32"
    quantized_activations: str = "int8"  # GGUF matmuls on CPU, see QUANTIZED_ACTIVATIONS
    force_cpu: bool = False
    block_size: int = 16
    max_num_seqs: int = 256  # a ceiling; the KV budget bounds concurrency first
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's own limit
    memory_limit: MemoryLimit | None = None
    max_total_tokens: int | None = None
    enable_prefix_caching: bool = True
    overlap_schedule: bool = True  # plan step N+1 while the worker runs step N
    cuda_graphs: bool = True  # replay decode steps from graphs captured at start-up (CUDA only)
    seed: int = 0
    task: str = "generate"  # or "embed" (an embedding model, which may have no lm_head), or "score" (a
    # sequence-classification head, which the frontend applies to the pooled last token)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory); adapter i has id i + 1
    max_lora_rank: int = 64
    max_loras: int = 8  # adapters loaded at once (at start and through /v1/load_lora_adapter)
    enable_lora: bool = False  # the model is built for adapters (implied by lora_modules and runtime_lora)
    runtime_lora: bool = False  # /v1/load_lora_adapter may load adapters, from under lora_root only
    lora_root: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor-parallel ranks and nodes
    # The image processor's pixel bounds (media_settings.py): the frontend resizes by them, the memory
    # plan holds the largest image they allow.
    mm_processor_kwargs: dict = field(default_factory=dict)
    sleep_idle_seconds: float = 0.0  # idle this long, the worker sleeps (scheduler/residency.py); 0: never
    sleep_level: int = 1  # 1: free the KV cache (and offload weights on CUDA); 2: drop the weights too
    # Speculative decoding (worker/speculative/): "ngram" (proposals copied from the request's own tokens)
    # or "draft" (a small model of the same tokenizer, speculative_model); None: off.
    speculative_method: str | None = None
    speculative_num_tokens: int = 4  # tokens proposed per step at most
    speculative_model: str | None = None
    speculative_ngram_min: int = 2  # the shortest and longest suffix an n-gram proposal matches
    speculative_ngram_max: int = 4
    speculative_disable_batch_size: int = 8  # more running requests than this: nobody speculates
    # On a GPU: a GGUF mixture's first N layers keep their experts in host memory (worker/weights/offload.py);
    # None: as many as the memory limit needs.
    cpu_moe_layers: int | None = None
    keep_page_cache: bool = False  # leave a GGUF file's pages in the page cache once loaded (else dropped)

    @property
    def lora(self) -> bool:
        """The model is built for LoRA (no activation fused into a packed projection)."""
        return self.enable_lora or self.runtime_lora or bool(self.lora_modules)

    def __post_init__(self) -> None:
        # Messages name the crane-launch flag too: the CLI reports them as they are.
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype (--dtype) must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError("mamba_ssm_cache_dtype (--mamba-ssm-cache-dtype) must be one of "
                             f"{', '.join(STATE_DTYPES)}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError("quantized_activations (--quantized-activations) must be one of "
                             f"{', '.join(QUANTIZED_ACTIVATIONS)}")
        for name, flag in (("block_size", "--block-size"), ("max_num_seqs", "--max-concurrent"),
                           ("max_num_batched_tokens", "--max-num-batched-tokens")):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({flag}) must be at least 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len (--max-seq-len) must be >= 0")
        if self.cpu_moe_layers is not None and self.cpu_moe_layers < 0:
            raise ValueError("cpu_moe_layers (--cpu-moe-layers) must be >= 0")
        if self.max_total_tokens is not None and self.max_total_tokens < self.block_size:
            raise ValueError("max_total_tokens (--max-total-tokens) must hold at least one KV block")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} LoRA adapters were given but --max-loras is {self.max_loras}")
        if len({name for name, _ in self.lora_modules}) != len(self.lora_modules):
            raise ValueError("LoRA adapter names (--lora-modules) must be distinct")
        if self.runtime_lora and not (self.lora_root and Path(self.lora_root).is_dir()):
            raise ValueError("runtime_lora (--enable-runtime-lora) needs lora_root (--lora-root), the directory "
                             "adapters may be loaded from")
        if self.sleep_level not in (1, 2):
            raise ValueError("sleep_level (--sleep-level) must be 1 or 2")
        if self.sleep_idle_seconds < 0:
            raise ValueError("sleep_idle_seconds (--sleep-idle-seconds) must be >= 0")
        if self.sleep_idle_seconds and self.parallel.tensor_parallel_size > 1:
            raise ValueError("--sleep-idle-seconds serves one worker rank; it is not supported with "
                             "--tensor-parallel-size above 1 yet")
        self._check_speculation()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens (--max-num-batched-tokens) must be at least max_num_seqs "
                             "(--max-concurrent): every running sequence decodes one token per step")


    def _check_speculation(self) -> None:
        method = self.speculative_method
        if method is None:
            if self.speculative_model is not None:
                raise ValueError("speculative_model (--speculative-model) needs --speculative-method draft")
            return
        if method not in SPECULATIVE_METHODS:
            raise ValueError("speculative_method (--speculative-method) must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if method == "draft" and not self.speculative_model:
            raise ValueError("--speculative-method draft needs --speculative-model, a small model of the same "
                             "tokenizer (a directory or a GGUF file)")
        if method != "draft" and self.speculative_model is not None:
            raise ValueError(f"--speculative-model is the draft method's; --speculative-method {method} takes none")
        if not 1 <= self.speculative_num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_num_tokens (--speculative-num-tokens) must be in "
                             f"1..{MAX_SPECULATIVE_TOKENS}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("--speculative-ngram-min must be at least 1 and at most --speculative-ngram-max")
        if self.speculative_disable_batch_size < 1:
            raise ValueError("speculative_disable_batch_size (--speculative-disable-batch-size) must be at least 1")
        if self.task != "generate":
            raise ValueError(f"speculative decoding serves --task generate, not {self.task}")
        if self.parallel.tensor_parallel_size > 1:
            raise ValueError("speculative decoding runs on one worker rank; it is not supported with "
                             "--tensor-parallel-size above 1 yet")


SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `crane-launch` was told; frozen, handed to every process at spawn."""

    engine: EngineConfig
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8080
    unix_socket: str | None = None  # one model of several: its frontend listens here, behind the router
    cuda_devices: str | None = None  # one model of several: the GPUs its processes see (CUDA_VISIBLE_DEVICES)
    log_level: str = "info"
    log_format: str = "text"  # or "json": one object per line
    replica_name: str | None = None  # the metrics' replica label; None: host:port
    log_requests: bool = False  # prompts in the access log
    access_log: bool = True
    web_ui: bool = True  # the chat page at / and the status page at /status
    shutdown_grace: float = 30.0  # seconds in-flight requests may take to finish on SIGTERM
    num_frontends: int = 1
    max_queue: int = 1024  # requests waiting for a running slot; more get 429
    max_request_generations: int = 256  # prompts x n of one request
    allowed_media_domains: tuple[str, ...] = ()  # hosts image URLs may be fetched from; none: data URLs only
    allowed_media_ports: tuple[int, ...] = (80, 443)  # ports image URLs may name
    allow_private_media_addresses: bool = False  # fetch from loopback, private and link-local addresses too
    max_images_per_request: int = 32  # image parts of one request, counted before any is fetched or decoded
    max_image_pixels: int = 1 << 25  # an image's width x height, checked before its pixels are decoded
    max_video_seconds: float = 300.0  # a video's duration, read from its header before any frame is decoded
    max_video_frames: int = 256  # the frames a video samples to (Qwen3-VL: 2 a second)
    max_audio_seconds: float = 3600.0  # one transcription's audio, checked as it is decoded
    max_audio_samples: int | None = None  # frames x channels of an upload; None: see audio_sample_limit
    read_timeout: float = 30.0  # seconds a request's headers, then its body, may take; also keep-alive idle
    write_timeout: float = 60.0  # seconds a streaming client may leave its events unread
    max_connections: int = 1024  # open client connections per frontend; more are answered 503
    grammar_timeout: float = 10.0  # seconds an output constraint may take to compile in the frontend
    request_timeout: float = 0.0  # seconds from submission to the engine to finish; 0 = no limit
    api_key: str | None = None
    admin_api_key: str | None = None  # guards the routes that change server state; default: api_key
    weights_root: str | None = None  # where /update_weights_from_disk may read; None: the model's directory
    max_request_bytes: int | None = None  # None: sized to the context window (FrontendState)
    health_generate_timeout: float = 30.0
    tool_call_parser: str = "auto"  # TOOL_CALL_PARSERS; auto: by the model's architecture
    reasoning_parser: str = "auto"  # REASONING_PARSERS; auto: when the vocabulary has <think> and </think>
    pooling: Pooling = field(default_factory=Pooling)  # how /v1/embeddings pools (engine.task == "embed")
    settings: dict = field(default_factory=dict)  # key -> {"value", "source"}, for /server_info
    unknown_env: tuple[str, ...] = ()  # CRANE_* variables that name no setting (warned at start)

    @property
    def replica(self) -> str:
        return self.replica_name or f"{self.host}:{self.port}"

    @property
    def logs(self) -> LogSettings:
        return LogSettings(self.log_level, self.log_format, self.model_name if self.unix_socket else "")

    @property
    def audio_sample_limit(self) -> int:
        """--max-audio-samples, else AUDIO_SAMPLES_PER_SECOND for each of --max-audio-seconds."""
        return self.max_audio_samples or int(AUDIO_SAMPLES_PER_SECOND * self.max_audio_seconds)


# ---- environment ----------------------------------------------------------------------------------


def cpu_isa_cap() -> str | None:
    """CRANE_MP_ISA: the highest CPU tier crane-mp's own code may use (None: whatever the CPU has)."""
    value = os.environ.get("CRANE_MP_ISA", "").strip().lower()
    if not value:
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"CRANE_MP_ISA={value!r} is not a CPU tier; use one of {', '.join(CPU_ISAS)}")
    return value


def pools_outputs(task: str) -> bool:
    """The task's requests return a pooled hidden state, not tokens (embed, score): no lm_head needed."""
    return task in ("embed", "score")


def native_kernels_disabled() -> bool:
    """CRANE_MP_NO_NATIVE_KERNELS=1: never build or use the C++ kernels (portable torch ops only)."""
    return os.environ.get("CRANE_MP_NO_NATIVE_KERNELS", "").strip() not in ("", "0")


def cache_root() -> Path:
    """CRANE_MP_CACHE, else ~/.cache/crane-mp: the demo model and the compiled kernels live here."""
    root = os.environ.get("CRANE_MP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "crane-mp")
    return Path(root)


def fault_injection_token() -> int | None:
    """CRANE_MP_FAULT_TOKEN=ID, a test hook: the worker raises while sampling for any request whose
    prompt holds token ID (the fault-isolation tests); unset in production."""
    value = os.environ.get("CRANE_MP_FAULT_TOKEN", "").strip()
    return int(value) if value else None


ATTENTION_BACKENDS = ("triton", "native", "torch")


def attention_backend_override() -> str | None:
    """CRANE_MP_ATTENTION=triton|native|torch: the paged-attention implementation to use instead of the
    device's default (worker/cache/attention.py), to compare them or to rule one out."""
    value = os.environ.get("CRANE_MP_ATTENTION", "").strip().lower()
    if not value:
        return None
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"CRANE_MP_ATTENTION={value!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    return value
