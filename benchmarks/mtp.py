"""Multi-token prediction on a 4B-shape Qwen3.5 checkpoint (bf16 safetensors), with and without it, in one run.

    python benchmarks/mtp.py build /models/q35-mtp
    python benchmarks/mtp.py run /models/q35-mtp
    python convert_hf_to_gguf.py /models/q35-mtp --outtype bf16 --outfile q35-mtp-bf16.gguf   # llama.cpp's
    llama-quantize q35-mtp-bf16.gguf q35-mtp-q4km.gguf Q4_K_M
    python benchmarks/mtp.py gguf q35-mtp-q4km.gguf

Random weights never agree by chance, so `build` builds the agreement: every layer of the target adds
nothing (zero output projections, read like any), so its next token is a function of the last one
through the final norm and the head; its prediction layer adds nothing either and its `fc` keeps
only the embedding half, so it guesses the token after next by that same function. `never-agrees/`
beside it is the same checkpoint (its tensors linked) whose prediction layer reads a permutation of
the embedding: it guesses wrong. `run` starts crane-mp for each setting (none, mtp with --speculative-
num-tokens 1 and 3, mtp that never agrees, ngram) and measures one stream and 16 (serving.py's load
generator, greedy, EOS ignored): output tok/s and TPOT, each as a multiple of the server's without
speculation, and the DRAM read bandwidth measured in the same run. `gguf` does the same on a GGUF
file of the checkpoint for crane-mp and llama-server (--spec-type draft-mtp) side by side. The settings
take turns --rounds times; each one-stream figure is its best round's. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vs_llama import DEFAULT_LLAMA, dram_read_gbs, machine  # noqa: E402
from speculative import measure  # noqa: E402

from crane_mp.testing.make_zoo import make_zoo_model  # noqa: E402

_LAYERS = 32
# A Qwen3.5-4B-like shape: three Gated DeltaNet layers to one gated-attention layer.
SHAPE = {"hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": _LAYERS, "num_attention_heads": 16,
         "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 32768,
         "tie_word_embeddings": False, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(_LAYERS)]}
_SILENT = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")
_TARGET_FILE, _LAYER_FILE = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def build(out: Path, seed: int) -> None:
    """The agreeing checkpoint in `out`, the one that never agrees in `out`/never-agrees."""
    make_zoo_model("qwen3_5_text", out, seed=seed, overrides=SHAPE, dtype="bfloat16", prediction_layer=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    (out / "model.safetensors").unlink()
    for name, tensor in tensors.items():
        if name.endswith(_SILENT):
            tensor.zero_()
    hidden = SHAPE["hidden_size"]
    layer = {name: tensors.pop(name) for name in list(tensors) if name.startswith("mtp.")}
    layer["mtp.pre_fc_norm_embedding.weight"].zero_()  # a (1 + w) norm: plain x / rms(x)
    layer["mtp.norm.weight"].copy_(tensors["model.norm.weight"])  # the target's final norm, as the head reads it
    save_file(tensors, str(out / _TARGET_FILE), metadata={"format": "pt"})
    del tensors
    variants = {out: torch.arange(hidden), out / "never-agrees": torch.randperm(hidden, generator=torch.Generator()
                                                                                   .manual_seed(seed))}
    for where, columns in variants.items():
        where.mkdir(exist_ok=True)
        fc = torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16)
        fc[torch.arange(hidden), columns] = 1  # the embedding half alone, permuted for the other
        save_file({**layer, "mtp.fc.weight": fc}, str(where / _LAYER_FILE), metadata={"format": "pt"})
        if where != out:
            for item in out.iterdir():
                if item.is_file() and item.name != _LAYER_FILE:
                    (where / item.name).unlink(missing_ok=True)
                    (where / item.name).symlink_to(item.resolve())
    weight_map = {name: _LAYER_FILE for name in layer}
    with safe_open(str(out / _TARGET_FILE), "pt") as f:
        weight_map |= {name: _TARGET_FILE for name in f.keys()}
    index = json.dumps({"metadata": {}, "weight_map": weight_map})
    for where in variants:
        (where / "model.safetensors.index.json").unlink(missing_ok=True)
        (where / "model.safetensors.index.json").write_text(index)
    print(out, out / "never-agrees")


_MTP = ["--speculative-method", "mtp", "--speculative-num-tokens"]
# Per setting, each server's (model path under the built checkpoint or the GGUF file, extra flags).
SETTINGS = {
    "none": {"crane-mp": (".", [])},
    "mtp-1": {"crane-mp": (".", [*_MTP, "1"])},
    "mtp-3": {"crane-mp": (".", [*_MTP, "3"])},
    "mtp-never-agrees": {"crane-mp": ("never-agrees", [*_MTP, "3"])},
    "ngram": {"crane-mp": (".", ["--speculative-method", "ngram", "--speculative-num-tokens", "3"])},
}
# The same on a GGUF file of that checkpoint (llama.cpp's converter keeps the layer; llama-quantize), each
# server started the way its users start it (speculative.py's commands) plus its MTP flags.
_LLAMA_MTP = ["--spec-type", "draft-mtp", "--spec-draft-n-min", "0", "--spec-draft-n-max"]
GGUF_SETTINGS = {
    "none": {"crane-mp": (".", []), "llama-server": (".", [])},
    "mtp-1": {"crane-mp": (".", [*_MTP, "1"]), "llama-server": (".", [*_LLAMA_MTP, "1"])},
    "mtp-3": {"crane-mp": (".", [*_MTP, "3"]), "llama-server": (".", [*_LLAMA_MTP, "3"])},
}


def compare(model: Path, table: dict[str, dict[str, tuple[str, list[str]]]], args) -> None:
    """Each server in each setting (args.settings), taking turns --rounds times; the best round of
    each at one stream, 16 streams in the first for args.batched."""
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                      "dram_gbs": dram_read_gbs(args.threads)}), flush=True)
    servers = [server for server in ("crane-mp", "llama-server") if server in table["none"]]
    best: dict[tuple[str, str, int], dict] = {}
    for round_ in range(args.rounds):
        for server in servers:
            for setting in args.settings:
                where, extra = table[setting][server]
                path = model if model.suffix == ".gguf" else model / where
                batched = round_ == 0 and setting in args.batched
                for row in measure(server, setting, path, extra, args, batched):
                    print(json.dumps({**row, "round": round_}), flush=True)
                    key = (server, setting, row["concurrency"])
                    if key not in best or row["output_tok_s"] > best[key]["output_tok_s"]:
                        best[key] = row
    print(json.dumps({"dram_gbs_after": dram_read_gbs(args.threads)}), flush=True)
    base = {(r["server"], r["concurrency"]): r["output_tok_s"] for r in best.values() if r["setting"] == "none"}
    print(f"\n{'server':<13} {'setting':<17} {'C':>3} {'tok/s':>7} {'TPOT p50':>9} {'x none':>7} {'errors':>6}")
    for r in best.values():
        ratio = r["output_tok_s"] / base[r["server"], r["concurrency"]] if base.get(
            (r["server"], r["concurrency"])) else float("nan")
        print(f"{r['server']:<13} {r['setting']:<17} {r['concurrency']:>3} {r['output_tok_s']:>7} "
              f"{r['tpot_p50_ms']:>9} {ratio:>7.2f} {r['errors']:>6}")


def _run_flags(parser: argparse.ArgumentParser, settings: dict, memory_limit: str) -> None:
    parser.add_argument("--settings", nargs="+", default=list(settings), choices=list(settings))
    parser.add_argument("--batched", nargs="*", default=["none", "mtp-3"], help="settings also measured at 16 streams")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--memory-limit", default=memory_limit, help="crane-mp's --gpu-memory-limit")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--port", type=int, default=8313)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("build")
    made.add_argument("out", type=Path)
    made.add_argument("--seed", type=int, default=0)
    runs = sub.add_parser("run")
    runs.add_argument("model", type=Path)
    _run_flags(runs, SETTINGS, "12G")
    side = sub.add_parser("gguf", help="crane-mp beside llama-server on a GGUF file of the built checkpoint")
    side.add_argument("model", type=Path)
    _run_flags(side, GGUF_SETTINGS, "10G")
    args = parser.parse_args()
    if args.command == "build":
        if args.out.exists():
            shutil.rmtree(args.out)
        build(args.out, args.seed)
    else:
        compare(args.model, GGUF_SETTINGS if args.command == "gguf" else SETTINGS, args)


if __name__ == "__main__":
    main()
