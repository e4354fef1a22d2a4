"""Reranking throughput on a Qwen3-Reranker-style model: documents scored per second and the prefix
cache's share of their prompt tokens.

    python benchmarks/rerank.py --model-path DIR [--documents 32 --rounds 4 --words 120]

DIR is a causal model whose vocabulary has `yes` and `no` (`--make DIR` first writes one: the small
Qwen3 shape of crane_mp.testing.make_model with the two tokens added). Starts crane-launch on it,
warms it, then sends --rounds /v1/rerank requests one after another, each one query against
--documents new documents of about --words words, and prints one JSON line: documents per second
per round (the first round computes the shared prompt prefix, the later ones may find it cached),
the prompt tokens, and the tokens the prefix cache served.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import requests

WORDS = ("paris weather spring rain sun river museum bread train city north south evening market garden "
         "history bridge tower street winter summer light stone music").split()


def make_reranker(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crane_mp.testing.make_model import make_model

    path = make_model("qwen3", "small", out, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["yes", "no"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--make", action="store_true", help="write the small reranker to --model-path first")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--server-args", default="")
    args = parser.parse_args()
    if args.make:
        make_reranker(Path(args.model_path))
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", args.model_path, "--port", str(args.port),
           "--no-access-log", *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(0)
    query = "which documents describe the weather of a city in the spring, and what its markets sell?"
    try:
        for line in proc.stdout:
            if "ready in" in line:
                break
        requests.post(url + "/v1/rerank", json={"query": "warm", "documents": ["up"]}, timeout=600).raise_for_status()
        rounds = []
        for _ in range(args.rounds):
            documents = [" ".join(rng.choices(WORDS, k=args.words)) for _ in range(args.documents)]
            before = requests.get(url + "/v1/stats", timeout=10).json()["prefix_cache_hits"]
            start = time.perf_counter()
            response = requests.post(url + "/v1/rerank", json={"query": query, "documents": documents}, timeout=600)
            seconds = time.perf_counter() - start
            response.raise_for_status()
            cached = requests.get(url + "/v1/stats", timeout=10).json()["prefix_cache_hits"] - before
            rounds.append({"docs_per_s": round(args.documents / seconds, 2), "seconds": round(seconds, 3),
                           "prompt_tokens": response.json()["usage"]["total_tokens"], "cached_tokens": cached})
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps({"bench": "rerank", "documents": args.documents, "words": args.words, "rounds": rounds}))


if __name__ == "__main__":
    main()
