"""Milliseconds per sampling step for a batch of rows, by sampling configuration (in-process).

    python benchmarks/sampler.py                          # 32 rows, vocabularies 8192 and 151936, CPU
    python benchmarks/sampler.py --rows 256 --device cuda

Logits are random with a standard deviation of 6, peaked as a trained model's usually are (flat rows
would send every top_p row to the whole-vocabulary path). Each step samples and records the tokens, as
the worker does.
"""

from __future__ import annotations

import argparse
import time

import torch

from crane_mp.protocol import SamplingParams
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.sampling.sampler import Sampler

CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k+min_p": SamplingParams(temperature=0.8, top_k=40, min_p=0.05),
    "all": SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.1, frequency_penalty=0.3,
                          presence_penalty=0.2, logit_bias={5: 1.0}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| vocab | " + " | ".join(CONFIGS) + " |")
    print("| --- " * (len(CONFIGS) + 1) + "|")
    for vocab in args.vocab:
        sampler = Sampler(vocab, platform_for(device))
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(6).to(device)
        cells = []
        for params in CONFIGS.values():
            states = [sampler.new_state(params, [1, 2, 3], (1,)) for _ in range(args.rows)]
            for step in range(args.steps + 3):
                if step == 3:
                    start = time.perf_counter()
                sampler.record(states, sampler.sample(logits.clone(), states)[0])
            cells.append(f"{(time.perf_counter() - start) / args.steps * 1e3:.2f} ms")
            for state in states:
                sampler.release(state)
        print(f"| {vocab} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
