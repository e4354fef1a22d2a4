"""crane-launch's flags (crane-oai's names), parsed and validated into a frozen ServerConfig.

A bad value fails at once with one line naming the flag (argparse's `error: argument --flag: ...`).
"""

from __future__ import annotations

import argparse
import os
import sys

from crane_mp.config import DTYPES, EngineConfig, ServerConfig, cpu_isa_cap, parse_memory_limit
from crane_mp.gguf_file import FORMATS, GGUFFileError, ModelSource, check_gguf, resolve_model_source
from crane_mp.worker.model_config import MODEL_TYPE_ALIASES


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
DEFAULT_MAX_CONCURRENT = 256
_non_negative_int = _int_at_least(0)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crane-launch", description="Serve a Llama-family model over OpenAI/SGLang APIs.")
    p.add_argument("--model-path", help="model directory (config.json, safetensors, tokenizer), or a .gguf file "
                                        "(or a directory holding one)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="weights format; auto: gguf for a .gguf file, else safetensors")
    p.add_argument("--demo", action="store_true", help="serve the built-in random-weight demo model")
    p.add_argument("--model-type", default="auto", choices=["auto", *sorted(MODEL_TYPE_ALIASES)])
    p.add_argument("--model-name", help="name shown in API responses (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is available")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--max-concurrent", type=_positive_int,
                   help="ceiling on running sequences; the KV-cache budget limits them first (default: 256, "
                        "or --max-num-batched-tokens if that is lower)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never reuse KV blocks across requests that share a prompt prefix")
    p.add_argument("--no-overlap-schedule", action="store_true",
                   help="plan each step only after the previous one returned (slower; for debugging)")
    p.add_argument("--max-seq-len", type=_non_negative_int, default=0, help="prompt + output limit; 0 = the model's")
    p.add_argument("--gpu-memory-limit", type=_memory_limit,
                   help="memory cap for weights + activations + KV cache: 8G, 5120M or a fraction like 0.75 "
                        "(on CPU it bounds host RAM)")
    p.add_argument("--max-total-tokens", type=_positive_int, help="cap on KV-cache tokens below what memory allows")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="per-step token budget; longer prompts are prefilled in chunks")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    p.add_argument("--shutdown-grace", type=_seconds, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--api-key", default=os.environ.get("CRANE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $CRANE_API_KEY)")
    p.add_argument("--max-request-bytes", type=_positive_int,
                   help="largest request body accepted, bigger ones get 413 (default: 512 bytes per token of "
                        "the context window, a batch of 64 full-window token-id prompts; at least 1 MiB)")
    p.add_argument("--health-generate-timeout", type=_seconds, default=30.0,
                   help="seconds /health_generate waits for its one-token generation before answering 503")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


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


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cpu_isa_cap()
    except ValueError as err:
        parser.error(str(err))
    if args.demo == bool(args.model_path):
        parser.error("give exactly one of --model-path DIR or --demo")
    if args.demo:
        from crane_mp.testing.demo import demo_model_path

        args.model_path = str(demo_model_path())
    source = _model_source(args.model_path, args.format)
    if args.max_concurrent is None:
        args.max_concurrent = min(DEFAULT_MAX_CONCURRENT, args.max_num_batched_tokens)
    elif args.max_num_batched_tokens < args.max_concurrent:
        parser.error("argument --max-num-batched-tokens: must be at least --max-concurrent")
    if args.max_total_tokens is not None and args.max_total_tokens < args.block_size:
        parser.error("argument --max-total-tokens: must hold at least one KV block")
    engine = EngineConfig(
        model_path=str(source.path),
        model_type=args.model_type,
        model_format=source.format,
        dtype=args.dtype,
        force_cpu=args.cpu,
        block_size=args.block_size,
        max_num_seqs=args.max_concurrent,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_seq_len,
        memory_limit=args.gpu_memory_limit,
        max_total_tokens=args.max_total_tokens,
        enable_prefix_caching=not args.no_prefix_cache,
        overlap_schedule=not args.no_overlap_schedule,
        seed=args.seed,
    )
    return ServerConfig(
        engine=engine,
        model_name=args.model_name or (source.gguf_file.stem if source.gguf_file else source.model_dir.name),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        shutdown_grace=args.shutdown_grace,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        health_generate_timeout=args.health_generate_timeout,
    )
