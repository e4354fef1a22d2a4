"""Logprobs in OpenAI's two shapes: the legacy completions object and the chat `content` list."""

from __future__ import annotations

from typing import Any

from crane_mp.protocol import PromptLogprobs, TokenLogprobs


class TokenText:
    """Token id -> the text it stands for alone, cached (logprob responses name every token)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def scored_prompt_positions(chunks: list[PromptLogprobs]) -> dict[int, tuple[float, list[int], list[float]]]:
    """Prompt position -> (logprob, top ids, top logprobs), from the engine's chunked reports."""
    scored = {}
    for chunk in chunks:
        for i, value in enumerate(chunk.logprobs):
            scored[chunk.start + i] = (value, chunk.top_token_ids[i], chunk.top_logprobs[i])
    return scored


def completion_logprobs(
    token_text: TokenText,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    num_top: int,
    offset: int = 0,
    prompt_ids: list[int] | None = None,
    prompt_logprobs: list[PromptLogprobs] | None = None,
) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; with echo the prompt comes first
    and its first token has null logprobs (nothing precedes it)."""
    tokens, values, tops, offsets = [], [], [], []

    def add(token_id: int, value: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        text = token_text(token_id)
        tokens.append(text)
        values.append(value)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)

    if prompt_ids is not None:
        scored = scored_prompt_positions(prompt_logprobs or [])
        for pos, token_id in enumerate(prompt_ids):
            if pos == 0 or pos not in scored:
                add(token_id, None, None)
                continue
            value, top_ids, top_values = scored[pos]
            add(token_id, value, _top_dict(token_text, token_id, value, top_ids, top_values) if num_top else None)
    for token_id, lp in zip(token_ids, logprobs):
        if lp is None:
            add(token_id, None, None)
        else:
            top = _top_dict(token_text, token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs) if num_top else None
            add(token_id, lp.logprob, top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(token_text, token_id, value, top_ids, top_values) -> dict[str, float]:
    top = {token_text(i): v for i, v in zip(top_ids, top_values)}
    top.setdefault(token_text(token_id), value)  # the chosen token is always listed, as vLLM does
    return top


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]} for the given tokens."""
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        if lp is None:
            continue
        text = token_text(token_id)
        content.append({
            "token": text,
            "logprob": lp.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": token_text(i), "logprob": v, "bytes": list(token_text(i).encode())}
                for i, v in zip(lp.top_token_ids, lp.top_logprobs)
            ],
        })
    return {"content": content}
