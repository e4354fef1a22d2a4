"""`python -m crane_mp.generate`: generate from prompts with the in-process engine (no server).

    python -m crane_mp.generate --demo "The capital of France is" "Once upon a time"
    python -m crane_mp.generate --model-path DIR --max-tokens 64 --temperature 0.7 "Hello"
"""

from __future__ import annotations

import argparse
import time

from crane_mp.config import DTYPES, EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="+")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path")
    source.add_argument("--demo", action="store_true", help="use the built-in random-weight demo model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    if args.demo:
        from crane_mp.testing.demo import demo_model_path

        args.model_path = str(demo_model_path())
    engine = LLMEngine(EngineConfig(model_path=args.model_path, force_cpu=args.cpu, dtype=args.dtype), progress=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate([tokenizer.encode(p) for p in args.prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, ids in zip(args.prompts, outputs):
        print(f"{prompt!r} -> {tokenizer.decode(ids, skip_special_tokens=True)!r}")
    total = sum(len(o) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)")


if __name__ == "__main__":
    main()
