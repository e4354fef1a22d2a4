"""Speculative decoding on an 8B-shape Q4_K_M file, crane-mp beside llama-server, in one run.

    python -m crane_mp.testing.random_gguf --out /models/target.gguf --silent-layers-from 2
    python -m crane_mp.testing.random_gguf --out /models/agrees.gguf --layers 2
    python -m crane_mp.testing.random_gguf --out /models/other.gguf --layers 2 --seed 1
    python benchmarks/speculative.py /models/target.gguf /models/agrees.gguf /models/other.gguf

Random weights never agree by chance, so the agreement is built: the target's layers past the first two
add nothing (zero output projections) yet are read like any layer, and `agrees.gguf` is those two layers
with the same embeddings and head, so both give the same tokens; `other.gguf` is two layers of another
seed, which the target rejects. Each server runs each setting on its own, started the way its users start
it (gguf_vs_llama.py's commands, plus its speculative-decoding flags: crane-mp --speculative-model /
--speculative-method ngram, llama-server -md --spec-type draft-simple / --spec-type ngram-simple, 4 tokens
a step at most): one stream, and 16 streams for the settings named in --batched. Output tok/s and TPOT
(serving.py's load generator, greedy, EOS ignored), each as a multiple of the same server's without
speculation, and the DRAM read bandwidth of the machine measured in the same run. A shared host's speed
drifts by a fifth within minutes, so the settings take turns --rounds times (each server started anew)
and each one-stream figure is its best round's. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vs_llama import DEFAULT_LLAMA, dram_read_gbs, load, machine, stop, wait_ready  # noqa: E402

# llama-server loads a -md model but drafts with it only when told to (--spec-type, default none).
_LLAMA_DRAFT = ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]


def settings(target: Path, agrees: Path, other: Path) -> dict[str, dict[str, list[str]]]:
    """Per setting, each server's extra flags."""
    return {
        "none": {"crane-mp": [], "llama-server": []},
        "draft-agrees": {"crane-mp": ["--speculative-model", str(agrees), "--speculative-num-tokens", "4"],
                         "llama-server": ["-md", str(agrees), *_LLAMA_DRAFT]},
        "draft-never-agrees": {"crane-mp": ["--speculative-model", str(other), "--speculative-num-tokens", "4"],
                               "llama-server": ["-md", str(other), *_LLAMA_DRAFT]},
        # Both look up the last 2 tokens (crane-mp tries 4 and 3 first) and copy up to 4.
        "ngram": {"crane-mp": ["--speculative-method", "ngram", "--speculative-num-tokens", "4"],
                  "llama-server": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                                   "--spec-ngram-simple-size-m", "4"]},
    }


def start(server: str, target: Path, extra: list[str], args) -> subprocess.Popen:
    if server == "crane-mp":
        cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(target), "--gpu-memory-limit", args.memory_limit,
               "--port", str(args.port), *extra]
        env = dict(os.environ)
    else:
        cmd = [str(args.llama_server), "-m", str(target), "--host", "127.0.0.1", "--port", str(args.port), "-c",
               "16384", "-np", "16", "-t", str(args.threads), "-tb", str(args.threads), "--no-webui", *extra]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def measure(server: str, setting: str, target: Path, extra: list[str], args, batched: bool) -> list[dict]:
    url = f"http://127.0.0.1:{args.port}"
    proc = start(server, target, extra, args)
    rows = []
    try:
        wait_ready(url, proc)
        for concurrency in [1, 16] if batched else [1]:
            requests = max(2, 2 * concurrency)
            result = load(url, concurrency, requests, args.prompt_len, args.output_len, concurrency,
                          server == "llama-server")
            rows.append({"server": server, "setting": setting, "concurrency": concurrency,
                         "output_tok_s": result["output_tok_s"], "tpot_p50_ms": result["tpot_p50_ms"],
                         "errors": result["errors"]})
    finally:
        stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("agrees", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)
    parser.add_argument("--servers", nargs="+", default=["crane-mp", "llama-server"])
    parser.add_argument("--settings", nargs="+", default=["none", "draft-agrees", "draft-never-agrees", "ngram"])
    parser.add_argument("--batched", nargs="*", default=["none", "draft-agrees"],
                        help="settings also measured at 16 streams")
    parser.add_argument("--batched-servers", nargs="*", default=["crane-mp", "llama-server"],
                        help="the servers measured at 16 streams")
    parser.add_argument("--rounds", type=int, default=2, help="turns each setting takes at one stream")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--memory-limit", default="10G", help="crane-mp's --gpu-memory-limit (the draft's share too)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--port", type=int, default=8312)
    args = parser.parse_args()
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                      "dram_gbs": dram_read_gbs(args.threads)}), flush=True)
    table = settings(args.target, args.agrees, args.other)
    best: dict[tuple[str, str, int], dict] = {}
    for round_ in range(args.rounds):
        for server in args.servers:
            for setting in args.settings:
                batched = round_ == 0 and setting in args.batched and server in args.batched_servers
                for row in measure(server, setting, args.target, table[setting][server], args, batched):
                    print(json.dumps({**row, "round": round_}), flush=True)
                    key = (server, setting, row["concurrency"])
                    if key not in best or row["output_tok_s"] > best[key]["output_tok_s"]:
                        best[key] = row
    print(json.dumps({"dram_gbs_after": dram_read_gbs(args.threads)}), flush=True)
    rows = list(best.values())
    base = {(r["server"], r["concurrency"]): r["output_tok_s"] for r in rows if r["setting"] == "none"}
    print(f"\n{'server':<13} {'setting':<19} {'C':>3} {'tok/s':>7} {'TPOT p50':>9} {'x none':>7} {'errors':>6}")
    for r in rows:
        ratio = r["output_tok_s"] / base[r["server"], r["concurrency"]] if base.get((r["server"], r["concurrency"])) \
            else float("nan")
        print(f"{r['server']:<13} {r['setting']:<19} {r['concurrency']:>3} {r['output_tok_s']:>7} "
              f"{r['tpot_p50_ms']:>9} {ratio:>7.2f} {r['errors']:>6}")


if __name__ == "__main__":
    main()
