"""What 8-bit activations cost in accuracy: the int8 GGUF path against the float path, teacher-forced.

    python benchmarks/int8_agreement.py FILE.gguf [FILE.gguf ...] [--tokens 2000]

Both paths (`--quantized-activations int8` and `float`, same file, same KV-cache dtype) score the
same fixed text of --tokens tokens (crane_mp.testing.corpus, seed 0, through the file's tokenizer)
in one prefill each; at every position we compare the next-token distributions: top-1 agreement
(the int8 path's argmax equals the float path's) and the mean KL divergence KL(float || int8) in nats.
llama.cpp quantizes activations the same way, so its own agreement with the float path at the same
positions is the yardstick. One JSON line per file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.model_tokenizer import load_tokenizer
from crane_mp.testing.corpus import corpus
from crane_mp.worker.cache.attention import SeqSpan

_ROWS_PER_PASS = 64  # [rows, vocabulary] log-probabilities at a time


def fixed_ids(path: Path, count: int) -> list[int]:
    tokenizer = load_tokenizer(str(path))
    ids: list[int] = []
    lines = corpus(400, seed=0)
    while len(ids) < count:
        ids += tokenizer.encode("\n".join(lines), add_special_tokens=False)
        lines = lines[1:] + lines[:1]
    return ids[:count]


def final_hidden(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Hidden states after the last layer at every position: one paged prefill over fresh blocks."""
    runner = engine.worker.runner
    span = SeqSpan(0, len(ids), list(range(-(-len(ids) // runner.block_size))))
    with torch.inference_mode():
        return runner.forward([], [span], ids, list(range(len(ids))))


def compare(path: Path, count: int) -> dict:
    ids = fixed_ids(path, count)
    engines, hidden = {}, {}
    for mode in ("float", "int8"):
        engines[mode] = LLMEngine(EngineConfig(model_path=str(path), quantized_activations=mode,
                                               max_model_len=count, max_num_seqs=1, max_num_batched_tokens=count))
        start = time.perf_counter()
        hidden[mode] = final_hidden(engines[mode], ids)
        print(f"{path.name}: {mode} prefill of {count} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    agree, kl = 0, []
    with torch.inference_mode():
        for lo in range(0, count, _ROWS_PER_PASS):
            rows = slice(lo, min(count, lo + _ROWS_PER_PASS))
            ref = torch.log_softmax(engines["float"].worker.runner.model.compute_logits(hidden["float"][rows]).float(), -1)
            got = torch.log_softmax(engines["int8"].worker.runner.model.compute_logits(hidden["int8"][rows]).float(), -1)
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            kl += (ref.exp() * (ref - got)).sum(-1).tolist()
    return {"bench": "int8_agreement", "file": path.name, "positions": count, "top1_agreement": round(agree / count, 4),
            "mean_kl": round(sum(kl) / count, 6), "max_kl": round(max(kl), 4),
            "kv_cache_dtype": engines["int8"].worker.runner.kv_dtype.__repr__().removeprefix("torch.")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    for path in args.files:
        print(json.dumps(compare(path, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
