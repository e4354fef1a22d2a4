"""crane-launch's flags (crane-oai's names), layered over a `--config` file and CRANE_* variables
(settings.py), validated into a frozen ServerConfig.

A bad value fails at once with one line naming the flag, key or variable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from crane_mp.config import (
    AUDIO_SAMPLES_PER_SECOND,
    DTYPES,
    KV_CACHE_DTYPES,
    LOG_FORMATS,
    QUANTIZED_ACTIVATIONS,
    REASONING_PARSERS,
    SPECULATIVE_METHODS,
    STATE_DTYPES,
    TASKS,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
    cpu_isa_cap,
    parse_memory_limit,
)
from crane_mp.media_settings import pixel_settings_problem
from crane_mp.models.config import MODEL_IMPLS, checkpoint_architecture
from crane_mp.models.gguf_file import FORMATS, GGUFFileError, ModelSource, check_gguf, resolve_model_source
from crane_mp.models.pooling import POOLING_METHODS, Pooling, sentence_transformers_pooling
from crane_mp.models.registry import MODEL_TYPE_ALIASES
from crane_mp.models.score_head import classifies
from crane_mp.parallel import ParallelConfig
from crane_mp.settings import SettingsError, resolve, settable_actions, unknown_env_names
from crane_mp.speculative_flags import add_peer_flags, apply_peer_flags


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
DEFAULT_MAX_CONCURRENT = 256
DEFAULT_MAX_QUEUE = 1024


def default_num_frontends(num_cpus: int | None = None) -> int:
    """One frontend process per 8 cores, at most 4: below that the worker needs the cores more
    (benchmarks/RESULTS.md, "Several frontends")."""
    cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 8))


def _lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH, or a bare PATH named after its directory."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = os.path.basename(os.path.normpath(text)), text
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _mm_processor_kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({err})") from None
    problem = pixel_settings_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def _memory_limit(text: str):
    try:
        return parse_memory_limit(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="crane-launch", description="Serve a Llama-family model over OpenAI/SGLang APIs.",
        epilog="Every flag is also a key of the --config file (max-concurrent = 32) and an environment variable "
               "(CRANE_MAX_CONCURRENT=32); flags override the environment, which overrides the file.",
    )
    p.add_argument("--config", help="TOML file of settings (see configs/); flags and CRANE_* variables override it")
    p.add_argument("--model-path", help="model directory (config.json, safetensors, tokenizer), or a .gguf file "
                                        "(or a directory holding one); given more than once (each NAME=PATH or "
                                        "a bare path), one server serves every model, picked by each request's "
                                        "model (docs/operations.md, several models)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="weights format; auto: gguf for a .gguf file, else safetensors")
    p.add_argument("--demo", action="store_true", help="serve the built-in random-weight demo model")
    p.add_argument("--model-type", default="auto", choices=["auto", *sorted(MODEL_TYPE_ALIASES)])
    p.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS,
                   help="native: our own layers and kernels; transformers: transformers' modeling code on our "
                        "paged KV cache and scheduler (any causal LM it knows, slower); auto: native where we "
                        "have it, else transformers")
    p.add_argument("--model-name", "--served-model-name",
                   help="name shown in API responses (default: the directory name)")
    p.add_argument("--task", default="auto", choices=TASKS,
                   help="generate text, embed (/v1/embeddings only), score (/v1/rerank and /score with a "
                        "sequence-classification checkpoint), or transcribe (/v1/audio/transcriptions and "
                        "/translations with a Whisper checkpoint); auto: transcribe for Whisper, score for a "
                        "*ForSequenceClassification checkpoint, embed for a sentence-transformers one "
                        "(modules.json) or a BERT-family encoder, else generate")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters in PEFT's format to serve beside the base model; a request picks one by "
                        "naming it as its model (SGLang: lora_path)")
    p.add_argument("--enable-lora", action="store_true",
                   help="build the model for LoRA adapters; implied by --lora-modules and --enable-runtime-lora")
    p.add_argument("--enable-runtime-lora", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (404 otherwise), loading only "
                        "from under --lora-root; guarded by --admin-api-key")
    p.add_argument("--lora-root", help="the directory run-time adapters may be loaded from (a lora_path resolves "
                                       "inside it, symlinks followed)")
    p.add_argument("--load-on-demand", action="store_true",
                   help="several models: load each when a request first names it (pinned ones at start), evicting "
                        "the least recently used idle model when --gpu-memory-limit has no room; off: all at start")
    p.add_argument("--pinned-models", nargs="+", default=[], metavar="NAME",
                   help="several models: these load at start and are never evicted (a [[models]] table: pinned = "
                        "true)")
    p.add_argument("--model-load-timeout", type=_positive_seconds, default=300.0,
                   help="several models: seconds a request may wait for its model to load (503 past it)")
    p.add_argument("--sleep-idle-seconds", type=_seconds, default=0.0,
                   help="after this many seconds without a request the worker frees memory (--sleep-level) until "
                        "the next request wakes it; 0: only when POST /sleep asks")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=1,
                   help="what an idle sleep frees: 1, the KV cache (on a GPU the weights also move to host "
                        "memory); 2, the weights too (the wake-up reads them from disk again)")
    p.add_argument("--weights-root", help="the directory /update_weights_from_disk may read new weights from "
                                          "(default: the directory holding --model-path)")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   help="speculative decoding: ngram proposes the tokens that followed the latest earlier match of "
                        "the request's last tokens (its prompt and output: no second model); draft runs "
                        "--speculative-model; mtp runs the checkpoint's multi-token-prediction layer (DeepSeek-V3, "
                        "GLM-4.5, Qwen3.5, Qwen3-Next; a GGUF file holds it where llama.cpp's converter kept it). "
                        "The model verifies the proposals in one pass: "
                        "the same tokens as without (greedy and seeded requests alike), often several per pass over "
                        "the weights")
    p.add_argument("--speculative-num-tokens", "--num-speculative-tokens", type=_positive_int, default=4,
                   help="tokens proposed per step at most")
    p.add_argument("--speculative-model", metavar="PATH",
                   help="the draft model (a directory or a GGUF file) of the same tokenizer; implies "
                        "--speculative-method draft")
    p.add_argument("--speculative-ngram-min", type=_positive_int, default=2,
                   help="ngram: the shortest run of last tokens a match must repeat")
    p.add_argument("--speculative-ngram-max", type=_positive_int, default=4,
                   help="ngram: the longest run of last tokens matched (longer matches are tried first)")
    p.add_argument("--speculative-disable-batch-size", type=_positive_int, default=8,
                   help="with more requests running than this, none speculates (a large batch is no longer "
                        "bound by reading the weights)")
    add_peer_flags(p)
    p.add_argument("--max-lora-rank", type=_positive_int, default=64, help="largest LoRA rank accepted")
    p.add_argument("--max-loras", type=_positive_int, default=8,
                   help="LoRA adapters loaded at once, at start and through /v1/load_lora_adapter")
    p.add_argument("--pooling", choices=POOLING_METHODS,
                   help="embeddings: last token, mean or first (CLS) token of the final hidden states (default: "
                        "the checkpoint's sentence-transformers setting, else last); implies --task embed unless "
                        "--task says otherwise")
    p.add_argument("--tensor-parallel-size", "--tp-size", "-tp", type=_positive_int, default=1,
                   help="worker ranks the model is split over (attention heads, MLP units, vocabulary), one per GPU "
                        "or, on CPU, each with its share of the cores; joined by torch.distributed (NCCL on CUDA, "
                        "gloo on CPU)")
    p.add_argument("--nnodes", type=_positive_int, default=1,
                   help="hosts the tensor-parallel ranks run on, each starting --tensor-parallel-size / --nnodes of "
                        "them; node 0 serves HTTP")
    p.add_argument("--node-rank", type=_non_negative_int, default=0,
                   help="this host's place among --nnodes; above 0 it runs worker ranks only")
    p.add_argument("--dist-init-addr", metavar="HOST:PORT",
                   help="node 0's address and a free port, where every node's ranks meet (needed with --nnodes)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is available")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage; auto: 16-bit on CPU (bf16 with native bf16 math, else f16; the compute "
                        "dtype for --task embed and transcribe and for image models), the compute dtype on CUDA")
    p.add_argument("--mamba-ssm-cache-dtype", default="float32", choices=STATE_DTYPES,
                   help="the recurrent state of linear-attention layers (Qwen3.5, Qwen3-Next), one per running "
                        "sequence; 16-bit halves the state pool but rounds the state every token")
    p.add_argument("--quantized-activations", default="int8", choices=QUANTIZED_ACTIVATIONS,
                   help="GGUF matmuls on CPU: int8 activations with integer dot products (llama.cpp's scheme), "
                        "or float (exact, slower)")
    p.add_argument("--max-concurrent", type=_positive_int,
                   help="ceiling on running sequences; the KV-cache budget limits them first (default: 256, "
                        "or --max-num-batched-tokens if that is lower)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never reuse KV blocks across requests that share a prompt prefix")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying graphs captured at start-up "
                        "(faster start, slower decode; for debugging)")
    p.add_argument("--no-overlap-schedule", action="store_true",
                   help="plan each step only after the previous one returned (slower; for debugging)")
    p.add_argument("--max-seq-len", type=_non_negative_int, default=0, help="prompt + output limit; 0 = the model's")
    p.add_argument("--gpu-memory-limit", type=_memory_limit,
                   help="memory cap for weights + activations + KV cache (on CUDA also the CUDA context and "
                        "libraries: what nvidia-smi shows): 8G, 5120M or a fraction like 0.75 (on CPU it bounds host "
                        "RAM); with several models, every loaded model together")
    p.add_argument("--cpu-moe-layers", "--n-cpu-moe", type=_non_negative_int, default=None, metavar="N",
                   help="on a GPU, keep the experts of a GGUF mixture-of-experts model's first N layers in host "
                        "memory, run by the CPU kernels (llama.cpp's --n-cpu-moe); unset: as many as --gpu-memory-limit "
                        "needs (none when the model fits); on CPU hosts nothing changes")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="leave a GGUF file's pages in the OS page cache after loading; by default each tensor's "
                        "pages are dropped once copied into the worker's own layout, so the host holds the weights "
                        "once and the copies reuse that memory (on VMs that return freed memory to their host, "
                        "several times faster); keep them to restart often from a slow disk")
    p.add_argument("--max-total-tokens", type=_positive_int, help="cap on KV-cache tokens below what memory allows")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="per-step token budget; longer prompts are prefilled in chunks")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    p.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE,
                   help="requests allowed to wait for a running slot; beyond it a request gets 429 with Retry-After")
    p.add_argument("--max-request-generations", type=_positive_int, default=256,
                   help="most generations one request may start (its prompts times n); more get 400")
    p.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                   help="hosts whose http(s) image URLs chat messages may name (the domain and its subdomains); "
                        "none (the default): only data: URLs, and the server fetches nothing")
    p.add_argument("--allowed-media-ports", nargs="+", type=_port, default=[80, 443], metavar="PORT",
                   help="ports those image URLs may name (the scheme's own when they name none)")
    p.add_argument("--allow-private-media-addresses", action="store_true",
                   help="fetch image URLs whose host resolves to a loopback, private, link-local (cloud metadata), "
                        "shared or reserved address too; off, only public addresses are fetched")
    p.add_argument("--max-images-per-request", type=_positive_int, default=32,
                   help="image parts one chat request may hold, counted before any is fetched or decoded; more "
                        "get 400 (32 images of a typical size already fill a 32k-token window)")
    p.add_argument("--max-image-pixels", type=_positive_int, default=1 << 25,
                   help="largest image (width x height) a request may send, checked from its header before "
                        "its pixels are decoded; larger ones get 400")
    p.add_argument("--max-video-seconds", type=_positive_seconds, default=300.0,
                   help="longest video a request may send, read from its header before any frame is decoded; "
                        "longer gets 400")
    p.add_argument("--max-video-frames", type=_positive_int, default=256,
                   help="most frames a video may sample to (Qwen3-VL's processor takes 2 a second); more get 400")
    p.add_argument("--mm-processor-kwargs", type=_mm_processor_kwargs, default={},
                   help="the image processor's pixel bounds for every image, as JSON: "
                        "'{\"min_pixels\": 3136, \"max_pixels\": 1003520}' (vLLM's flag); a request's "
                        "mm_processor_kwargs may lower max_pixels, not raise it (default: the checkpoint's)")
    p.add_argument("--max-audio-seconds", type=_positive_seconds, default=3600.0,
                   help="longest audio one transcription or translation request may send; longer gets 400")
    p.add_argument("--max-audio-samples", type=_positive_int,
                   help="most samples (frames x channels) an uploaded audio file may declare, read from its header "
                        "before decoding (4 bytes each while decoding); more get 400 (default: "
                        f"{AUDIO_SAMPLES_PER_SECOND} per second of --max-audio-seconds, 48 kHz stereo for the "
                        "whole duration)")
    p.add_argument("--read-timeout", type=_positive_seconds, default=30.0,
                   help="seconds a request's headers, and then its body, may take to arrive (408 past it); an "
                        "idle keep-alive connection is closed after as long")
    p.add_argument("--write-timeout", type=_positive_seconds, default=60.0,
                   help="seconds a streaming client may leave its events unread before it is dropped and its "
                        "request aborted")
    p.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open client connections each frontend holds; past it a new connection is answered 503")
    p.add_argument("--grammar-timeout", type=_positive_seconds, default=10.0,
                   help="seconds an output constraint (JSON schema, regex, grammar) may take to compile; "
                        "400 past it")
    p.add_argument("--request-timeout", type=_seconds, default=0.0,
                   help="end a request that waited and ran longer than this many seconds with an error; 0 = never")
    # No default here: it depends on the host's cores, and the flags page is generated from this parser.
    p.add_argument("--num-frontends", type=_positive_int,
                   help="HTTP frontend processes sharing the port (SO_REUSEPORT); default: one per 8 cores, at most 4")
    p.add_argument("--shutdown-grace", type=_seconds, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health")
    p.add_argument("--admin-api-key",
                   help="the key of the routes that change server state (LoRA load/unload, /flush_cache, "
                        "/abort_request, /sleep, /wake_up, /update_weights_from_disk) instead of --api-key")
    p.add_argument("--max-request-bytes", type=_positive_int,
                   help="largest request body accepted, bigger ones get 413 (default: 512 bytes per token of "
                        "the context window, a batch of 64 full-window token-id prompts; at least 1 MiB)")
    p.add_argument("--health-generate-timeout", type=_seconds, default=30.0,
                   help="seconds /health_generate waits for its one-token generation before answering 503")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen2.5, Qwen3), qwen3_coder "
                        "(<tool_call> XML: Qwen3-Coder), llama3_json, mistral ([TOOL_CALLS]), granite, gemma4 "
                        "(<|tool_call>call:NAME{...}); auto picks qwen3_coder "
                        "where the chat template writes <function=...> calls, else by the vocabulary's markers and "
                        "the architecture; none refuses tools")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="read chat answers for thinking (<think> ... </think>: Qwen3, DeepSeek-R1, SmolLM3, "
                        "EXAONE 4; <seed:think> ... </seed:think>: Seed-OSS; <|channel>thought ... <channel|>: "
                        "Gemma 4) into reasoning_content; auto does when the vocabulary has a family's tags as "
                        "tokens; none never")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines, or one JSON object per line for log collectors")
    p.add_argument("--replica-name", default=None, metavar="NAME",
                   help="the `replica` label of every Prometheus series (default: HOST:PORT), so that the "
                        "replicas behind one router stay apart on one dashboard")
    p.add_argument("--log-requests", action="store_true",
                   help="include prompts in the per-request access log (never logged otherwise)")
    p.add_argument("--no-access-log", action="store_true", help="no line per finished request")
    p.add_argument("--no-web-ui", action="store_true",
                   help="serve no web pages: no chat page at / and no status page at /status (404 there)")
    return p


def _task_and_pooling(args, source: ModelSource, parser) -> tuple[str, Pooling]:
    """--task and the embedding pooling: the flags, else what a sentence-transformers checkpoint says."""
    try:
        declared = sentence_transformers_pooling(source.model_dir)
    except ValueError as err:
        if args.task != "generate" and args.pooling is None:
            parser.error(str(err))
        declared = None
    task = args.task
    arch = (checkpoint_architecture(source.model_dir, args.model_type, args.model_impl)
            if source.format == "safetensors" else None)
    encoder = arch is not None and arch.encoder
    speech = arch is not None and arch.media == "audio"
    if task == "auto":
        pools = declared or args.pooling or encoder
        task = "transcribe" if speech else "score" if classifies(source.model_dir) else "embed" if pools else "generate"
    if task == "generate" and encoder:
        parser.error("this checkpoint is an encoder (BERT family): it serves --task embed or --task score, not text")
    if (task == "transcribe") != speech:
        parser.error("--task transcribe serves a speech-to-text checkpoint (Whisper), and a Whisper checkpoint "
                     f"serves only --task transcribe, not {task}" if speech else
                     "--task transcribe needs a speech-to-text checkpoint (Whisper)")
    if task == "transcribe":
        return task, Pooling("last")
    if task == "score":  # the head says which token it reads (score_head.py)
        if source.format == "gguf":
            parser.error("--task score needs a safetensors sequence-classification checkpoint, not a GGUF file")
        return task, Pooling("last", False, False)
    # A bare encoder without a sentence-transformers configuration pools its [CLS] token, as BERT's own
    # pooler reads it; a decoder its last.
    pooling = declared or Pooling("cls" if encoder else "last")
    if args.pooling is not None:
        pooling = Pooling(args.pooling, pooling.normalize, pooling.chat_template)
    return task, pooling


def _model_source(path: str, fmt: str) -> ModelSource:
    """Resolve --model-path/--format and check a GGUF file before any process starts; a bad path or
    file ends crane-launch here with one line naming it."""
    try:
        source = resolve_model_source(path, fmt)
        if source.format == "gguf":
            check_gguf(source.gguf_file)
    except (FileNotFoundError, GGUFFileError) as err:
        sys.exit(f"crane-launch: error: {err}")
    return source


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    parser = build_parser()
    environ = os.environ if environ is None else environ
    try:
        args, sources = resolve(parser, argv, environ)
    except SettingsError as err:
        sys.exit(f"crane-launch: error: {err}")
    try:
        cpu_isa_cap()
    except ValueError as err:
        parser.error(str(err))
    if args.num_frontends is None:
        args.num_frontends = default_num_frontends()
    if args.num_frontends > 1 and args.port == 0:
        parser.error("argument --port: several frontends need one known port, not 0")
    _pick_model_layer(args, sources)
    if args.demo == bool(args.model_path):
        parser.error("give exactly one of --model-path DIR or --demo")
    if args.demo:
        from crane_mp.testing.demo import demo_model_path

        args.model_path = str(demo_model_path())
    source = _model_source(args.model_path, args.format)
    if args.max_concurrent is None:
        args.max_concurrent = min(DEFAULT_MAX_CONCURRENT, args.max_num_batched_tokens)
    task, pooling = _task_and_pooling(args, source, parser)
    try:
        apply_peer_flags(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        engine = EngineConfig(
            model_path=str(source.path),
            model_type=args.model_type,
            model_impl=args.model_impl,
            model_format=source.format,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            mm_processor_kwargs=args.mm_processor_kwargs,
            quantized_activations=args.quantized_activations,
            force_cpu=args.cpu,
            block_size=args.block_size,
            max_num_seqs=args.max_concurrent,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_seq_len,
            memory_limit=args.gpu_memory_limit,
            max_total_tokens=args.max_total_tokens,
            enable_prefix_caching=not args.no_prefix_cache,
            overlap_schedule=not args.no_overlap_schedule,
            cuda_graphs=not args.no_cuda_graph,
            seed=args.seed,
            task=task,
            lora_modules=tuple(args.lora_modules),
            max_lora_rank=args.max_lora_rank,
            max_loras=args.max_loras,
            enable_lora=args.enable_lora,
            runtime_lora=args.enable_runtime_lora,
            lora_root=args.lora_root,
            sleep_idle_seconds=args.sleep_idle_seconds,
            sleep_level=args.sleep_level,
            speculative_method=args.speculative_method or ("draft" if args.speculative_model else None),
            speculative_num_tokens=args.speculative_num_tokens,
            speculative_model=args.speculative_model,
            speculative_ngram_min=args.speculative_ngram_min,
            speculative_ngram_max=args.speculative_ngram_max,
            speculative_disable_batch_size=args.speculative_disable_batch_size,
            cpu_moe_layers=args.cpu_moe_layers,
            keep_page_cache=args.keep_page_cache,
            parallel=ParallelConfig(args.tensor_parallel_size, args.nnodes, args.node_rank, args.dist_init_addr),
        )
    except ValueError as err:
        parser.error(str(err))
    return ServerConfig(
        engine=engine,
        model_name=args.model_name or (source.gguf_file.stem if source.gguf_file else source.model_dir.name),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
        replica_name=args.replica_name,
        log_requests=args.log_requests,
        access_log=not args.no_access_log,
        web_ui=not args.no_web_ui,
        shutdown_grace=args.shutdown_grace,
        num_frontends=args.num_frontends,
        max_queue=args.max_queue,
        max_request_generations=args.max_request_generations,
        allowed_media_domains=tuple(args.allowed_media_domains),
        allowed_media_ports=tuple(args.allowed_media_ports),
        allow_private_media_addresses=args.allow_private_media_addresses,
        max_images_per_request=args.max_images_per_request,
        max_image_pixels=args.max_image_pixels,
        max_video_seconds=args.max_video_seconds,
        max_video_frames=args.max_video_frames,
        max_audio_seconds=args.max_audio_seconds,
        max_audio_samples=args.max_audio_samples,
        read_timeout=args.read_timeout,
        write_timeout=args.write_timeout,
        max_connections=args.max_connections,
        grammar_timeout=args.grammar_timeout,
        request_timeout=args.request_timeout,
        api_key=args.api_key or None,
        admin_api_key=args.admin_api_key or None,
        weights_root=args.weights_root,
        max_request_bytes=args.max_request_bytes,
        health_generate_timeout=args.health_generate_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        pooling=pooling,
        settings=_effective_settings(args, sources, parser),
        unknown_env=tuple(unknown_env_names(environ, settable_actions(parser))),
    )


_LAYER_RANK = {"default": 0, "file": 1, "env": 2, "cli": 3}


def _pick_model_layer(args: argparse.Namespace, sources: dict[str, str]) -> None:
    """--model-path and --demo exclude each other: when they come from different layers (a file with
    demo = true, a --model-path flag), the higher layer's choice stands."""
    if not (args.demo and args.model_path):
        return
    path_rank = _LAYER_RANK[sources["model_path"].split()[0]]
    demo_rank = _LAYER_RANK[sources["demo"].split()[0]]
    if path_rank > demo_rank:
        args.demo, sources["demo"] = False, sources["model_path"]
    elif demo_rank > path_rank:
        args.model_path, sources["model_path"] = None, sources["demo"]


def _effective_settings(args: argparse.Namespace, sources: dict[str, str], parser) -> dict[str, dict]:
    """key -> {"value", "source"} for /server_info; the API key's value is never shown."""
    out = {}
    for dest in settable_actions(parser):
        value = getattr(args, dest)
        if dest in ("api_key", "admin_api_key") and value:
            value = "(set)"
        elif dest == "gpu_memory_limit" and value is not None:
            value = value.num_bytes if value.num_bytes is not None else value.fraction
        out[dest.replace("_", "-")] = {"value": value, "source": sources[dest]}
    return out
