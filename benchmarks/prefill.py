"""One long prompt's prefill in process: seconds, tokens/s, and the page faults and kernel time it cost.

    python benchmarks/prefill.py MODEL.gguf [--prompt-len 2000] [--prompts 2]

`LLMEngine` (the worker's forward, no HTTP), greedy, one output token; random token ids, a fresh prompt
each time (nothing from the prefix cache). The first prompt also touches its KV blocks and the heap for
the first time: the later ones are the steady state. Prints one JSON line per prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_path")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model_path=args.model_path))
    rng, vocab = random.Random(0), engine.worker.runner.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill(length: int) -> float:
        engine.add_request([rng.randrange(10, vocab) for _ in range(length)], params)
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start

    prefill(64)  # the first step's one-time costs
    for index in range(args.prompts):
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = prefill(args.prompt_len)
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"prompt": index, "prompt_len": args.prompt_len, "seconds": round(seconds, 2),
                          "tok_s": round(args.prompt_len / seconds, 1),
                          "minor_faults": after.ru_minflt - before.ru_minflt,
                          "system_s": round(after.ru_stime - before.ru_stime, 2),
                          "user_s": round(after.ru_utime - before.ru_utime, 2)}), flush=True)


if __name__ == "__main__":
    main()
