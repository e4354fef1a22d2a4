"""Prefill time of a Gemma 4 checkpoint in the engine, with its KV-sharing layers computing only the rows
a step reads (each finished prompt's last row) and with every row, side by side in one process.

    python benchmarks/gemma4_prefill.py --model G --prompt-len 256 512 --repeats 3

G: e.g. `python -m crane_mp.testing.make_zoo --family gemma4_text --preset gemma4-e2b --dtype bfloat16
--out G`. Each figure is the median of `repeats` one-token requests of a fresh random prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.worker.models.gemma4 import Gemma4TextModel


def prefill_seconds(engine: LLMEngine, prompt_len: int, repeats: int, seed: int) -> float:
    vocab = engine.worker.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        prompt = torch.randint(3, min(vocab, 30000), (prompt_len,), generator=gen).tolist()
        start = time.perf_counter()
        engine.generate([prompt], one)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    longest = max(args.prompt_len)
    engine = LLMEngine(EngineConfig(model_path=args.model, max_model_len=longest + 16, max_num_seqs=4,
                                    max_num_batched_tokens=max(longest, 512), enable_prefix_caching=False))
    engine.generate([[5] * 8], SamplingParams(max_tokens=1))  # warm-up
    every_row = Gemma4TextModel._reading_rows
    print("| prompt tokens | rows read only: s | tok/s | every row: s | tok/s | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in args.prompt_len:
        shortcut = prefill_seconds(engine, length, args.repeats, length)
        Gemma4TextModel._reading_rows = lambda self, num_rows: None
        try:
            full = prefill_seconds(engine, length, args.repeats, length)
        finally:
            Gemma4TextModel._reading_rows = every_row
        print(f"| {length} | {shortcut:.2f} | {length / shortcut:.0f} | {full:.2f} | {length / full:.0f} | "
              f"{full / shortcut:.2f}x |")


if __name__ == "__main__":
    main()
