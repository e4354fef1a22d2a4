"""In-process generation throughput: crane-mp's LLMEngine vs transformers' generate, same checkpoint, same run.

    python benchmarks/engine.py                       # small qwen3 (bf16), batch 1/8/32, 128 in / 128 out
    python benchmarks/engine.py --batch-sizes 32 --skip-hf --model-path DIR
    CRANE_MP_ISA=avx2 python benchmarks/engine.py --dtype auto   # what an AVX2-only host runs

Prints a table and one JSON line per batch size. Greedy decoding with EOS ignored, so every request
produces exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=gen).tolist()


# Both engines warm up on the measured batch shape (full prompts, a few tokens), so one-time costs
# such as oneDNN building kernels for a new GEMM size are not timed for either.
WARMUP_TOKENS = 4


def bench_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == output_len for o in outputs)
    return elapsed


def bench_hf(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids),
                       **{**kwargs, "max_new_tokens": WARMUP_TOKENS, "min_new_tokens": WARMUP_TOKENS})
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="checkpoint directory (default: generate the small model)")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"],
                        help="engine dtype; auto: a bf16 checkpoint, run as the engine's --dtype auto picks for this CPU")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers' generate")
    args = parser.parse_args()

    model_dir = args.model_path
    if model_dir is None:
        model_dir = str(Path(tempfile.mkdtemp(prefix="crane-bench-")) / args.arch)
        make_model(args.arch, "small", model_dir, dtype="bfloat16" if args.dtype == "auto" else args.dtype)

    config = EngineConfig(
        model_path=model_dir,
        dtype=args.dtype,
        force_cpu=True,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batch_sizes)),
        max_model_len=args.prompt_len + args.output_len + 16,
    )
    engine = LLMEngine(config)
    vocab = engine.worker.model_config.vocab_size
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.worker.dtype).eval()

    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab)
        tokens = batch * args.output_len
        row = {
            "bench": "engine",
            "batch": batch,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "dtype": str(engine.worker.dtype).removeprefix("torch."),
            "isa": "/".join(engine.worker.platform.describe()),
            "threads": torch.get_num_threads(),
            "crane_tok_s": round(tokens / bench_engine(engine, prompts, args.output_len), 1),
        }
        if hf_model is not None:
            row["hf_tok_s"] = round(tokens / bench_hf(hf_model, prompts, args.output_len), 1)
            row["speedup"] = round(row["crane_tok_s"] / row["hf_tok_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'crane-mp tok/s':>15} {'transformers tok/s':>19} {'speedup':>8}")
    for row in rows:
        print(f"{row['batch']:>5} {row['crane_tok_s']:>15} {row.get('hf_tok_s', '-'):>19} {row.get('speedup', '-'):>8}")


if __name__ == "__main__":
    main()
