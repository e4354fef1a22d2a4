"""vLLM's and SGLang's speculative-decoding flags, taken as ours: a command line written for either
server starts crane-mp with the same speculation, or is refused naming what crane-mp does not serve."""

from __future__ import annotations

import argparse
import json

# vLLM's `method` names of the multi-token-prediction layers crane-mp serves (any "*_mtp" is one).
_VLLM_METHODS = {"ngram": "ngram", "draft_model": "draft", "mtp": "mtp"}
_VLLM_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size"}
_SGLANG_ALGORITHMS = {"NEXTN": "mtp", "EAGLE": "mtp", "EAGLE3": "mtp", "STANDALONE": "draft", "NGRAM": "ngram"}


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's and SGLang's speculative-decoding flags")
    group.add_argument("--speculative-config", metavar="JSON",
                       help="vLLM's form: {\"method\": \"ngram\" | \"draft_model\" | \"mtp\" (or a *_mtp name), "
                            "\"num_speculative_tokens\", \"model\", \"prompt_lookup_min\", \"prompt_lookup_max\", "
                            "\"disable_by_batch_size\"}")
    group.add_argument("--speculative-algorithm", type=str.upper, choices=sorted(_SGLANG_ALGORITHMS),
                       help="SGLang's form: NEXTN, or EAGLE without a draft model, is --speculative-method mtp; "
                            "STANDALONE draft; NGRAM ngram (EAGLE heads are not served)")
    group.add_argument("--speculative-draft-model-path", metavar="PATH", help="SGLang's --speculative-model")
    group.add_argument("--speculative-num-steps", type=int, help="SGLang's --speculative-num-tokens")
    group.add_argument("--speculative-num-draft-tokens", type=int,
                       help="SGLang's: the proposals and the token verified with them (--speculative-num-tokens + 1)")
    group.add_argument("--speculative-eagle-topk", type=int, help="SGLang's: 1 (tree drafting is not served)")


def apply_peer_flags(args: argparse.Namespace) -> None:
    """Fold the peers' flags into ours (args.speculative_*); ValueError names a flag crane-mp cannot honour
    or two that disagree."""
    wanted: dict[str, object] = {}
    if args.speculative_config is not None:
        wanted |= _vllm_config(args.speculative_config)
    if args.speculative_algorithm is not None:
        wanted |= _sglang_flags(args)
    elif args.speculative_draft_model_path is not None:
        wanted["speculative_model"] = args.speculative_draft_model_path
    for name, value in wanted.items():
        given = getattr(args, name)
        if name in ("speculative_method", "speculative_model") and given not in (None, value):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} and the speculative-decoding flags of vLLM's or SGLang's form "
                             f"({value}) disagree: give one")
        setattr(args, name, value)


def _vllm_config(text: str) -> dict[str, object]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--speculative-config is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(config) - _VLLM_KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not served; crane-mp takes "
                         f"{', '.join(sorted(_VLLM_KEYS))}")
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method is None:
        raise ValueError("--speculative-config needs a \"method\" (ngram, draft_model or mtp) or a \"model\"")
    ours = _VLLM_METHODS.get(method) or ("mtp" if str(method).endswith("_mtp") else None)
    if ours is None:
        raise ValueError(f"--speculative-config: method {method!r} is not served; use ngram, draft_model or mtp")
    out: dict[str, object] = {"speculative_method": ours}
    for key, name in (("num_speculative_tokens", "speculative_num_tokens"), ("model", "speculative_model"),
                      ("prompt_lookup_min", "speculative_ngram_min"), ("prompt_lookup_max", "speculative_ngram_max"),
                      ("disable_by_batch_size", "speculative_disable_batch_size")):
        if config.get(key) is not None:
            out[name] = config[key] if key == "model" else _whole(config[key], f"--speculative-config {key}")
    return out


def _sglang_flags(args: argparse.Namespace) -> dict[str, object]:
    algorithm, draft = args.speculative_algorithm, args.speculative_draft_model_path
    if algorithm.startswith("EAGLE") and draft is not None:
        raise ValueError(f"--speculative-algorithm {algorithm} with --speculative-draft-model-path: EAGLE heads are "
                         "not served; use STANDALONE for a draft model, or NEXTN for the checkpoint's own layer")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError("--speculative-eagle-topk: only 1 (one chain of proposals) is served")
    out: dict[str, object] = {"speculative_method": _SGLANG_ALGORITHMS[algorithm]}
    if draft is not None:
        out["speculative_model"] = draft
    steps, drafts = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is not None and drafts is not None and drafts != steps + 1:
        raise ValueError("--speculative-num-draft-tokens must be --speculative-num-steps + 1 (one chain)")
    if steps is not None or drafts is not None:
        out["speculative_num_tokens"] = steps if steps is not None else drafts - 1
    return out


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, not {value!r}")
    return value
