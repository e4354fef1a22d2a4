"""OpenAI request bodies as msgspec Structs: decoding validates types, unknown fields and ranges.

Anything a client gets wrong becomes a 400 with the offending field named, never a 500.
"""

from __future__ import annotations

from typing import Any

import msgspec

from crane_mp.frontend.errors import ApiError
from crane_mp.protocol import SamplingParams


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids of prompt and completion in the response


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec unions take one array type, see prompt_inputs.
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        param = str(err).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(err) else None
        raise ApiError(400, f"invalid request: {err}", param) from err
    except msgspec.DecodeError as err:
        raise ApiError(400, f"malformed JSON: {err}") from err


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise ApiError(400, f"{param} {message}", param)


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    _check(len(stops) <= 16, "stop", "may hold at most 16 strings")
    return [s for s in stops if s]


def sampling_params(
    req: _SamplingFields, max_tokens: int, vocab_size: int, logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Validate ranges the way OpenAI and vLLM do and build the engine's SamplingParams."""
    temperature = 1.0 if req.temperature is None else req.temperature
    _check(0.0 <= temperature <= 2.0, "temperature", "must be between 0 and 2")
    top_p = 1.0 if req.top_p is None else req.top_p
    _check(0.0 < top_p <= 1.0, "top_p", "must be in (0, 1]")
    top_k = 0 if req.top_k is None else req.top_k
    _check(top_k >= -1, "top_k", "must be -1 (disabled) or a positive integer")
    min_p = 0.0 if req.min_p is None else req.min_p
    _check(0.0 <= min_p <= 1.0, "min_p", "must be between 0 and 1")
    presence = req.presence_penalty or 0.0
    frequency = req.frequency_penalty or 0.0
    _check(-2.0 <= presence <= 2.0, "presence_penalty", "must be between -2 and 2")
    _check(-2.0 <= frequency <= 2.0, "frequency_penalty", "must be between -2 and 2")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    _check(0.0 < repetition <= 10.0, "repetition_penalty", "must be in (0, 10]")
    _check(max_tokens >= 1, "max_tokens", "must be at least 1")
    _check(0 <= req.min_tokens <= max_tokens, "min_tokens", "must be between 0 and max_tokens")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        _check(key.lstrip("-").isdigit() and 0 <= int(key) < vocab_size, "logit_bias", f"has an invalid token id {key!r}")
        _check(-100.0 <= value <= 100.0, "logit_bias", "values must be between -100 and 100")
        bias[int(key)] = value
    _check(1 <= req.n <= 16, "n", "must be between 1 and 16")
    stop_ids = req.stop_token_ids or []
    _check(all(0 <= t < vocab_size for t in stop_ids), "stop_token_ids", "must be valid token ids")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=bias or None,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def prompt_inputs(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: list-of-parts content flattened to one string
    (text parts joined by newlines, as vLLM does); other part types are refused."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        item = {"role": message.role, "content": content}
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out
