"""Tokenizer and chat template of the served model (frontend only).

Long prompts are encoded in a worker thread: the fast tokenizers release the GIL, so the event loop
keeps serving while they run. A text that cannot fit the context window is refused before its
whole tokenization is paid for: at once when its length alone proves it (no token spans more
characters than the longest in the vocabulary), else by counting it in chunks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import Environment, TemplateSyntaxError, meta

from crane_mp.frontend.openai.schemas import check_nesting
from crane_mp.frontend.serving.logprobs_format import TokenText
from crane_mp.frontend.tools.formats import MARKER_TEXTS
from crane_mp.frontend.web.errors import ApiError
from crane_mp.model_tokenizer import load_tokenizer

# Below this many characters encoding is faster than a thread hand-off.
_INLINE_CHARS = 2048
# Longer texts are counted chunk by chunk before a full encode, stopping once they cannot fit.
_COUNT_CHUNK_CHARS = 1 << 16


class TokenizerService:
    def __init__(self, model_path: str, model_format: str = "auto") -> None:
        self.tokenizer = load_tokenizer(model_path, model_format)
        self.backend = self.tokenizer._tokenizer  # the `tokenizers` object DecodeStream needs
        self.token_text = TokenText(self.tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # Byte-level and sentencepiece vocabularies spell a token with at least as many characters as
        # the text it covers.
        self.max_token_chars = max(len(token) for token in self.tokenizer.get_vocab())
        # The renderer sets these itself (special tokens included): a kwarg must not replace them.
        self.reserved_variables = _RENDERER_VARIABLES | set(self.tokenizer.special_tokens_map)
        self.template_variables = _template_variables(getattr(self.tokenizer, "chat_template", None))
        self.added_vocab = added = self.tokenizer.get_added_vocab()
        self.marker_tokens = {text: added[text] for text in MARKER_TEXTS if text in added}  # tool-call markers
        self.special_ids = frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)
        self.xml_tool_calls = writes_xml_calls(getattr(self.tokenizer, "chat_template", None))
        self.template_reads_parts = self.has_chat_template and _reads_text_parts(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    async def encode(self, text: str, max_tokens: int, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, or a 400 naming `param` when it has more than `max_tokens`."""
        if len(text) <= _INLINE_CHARS:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            if len(text) // self.max_token_chars > max_tokens:
                _refuse(len(text) // self.max_token_chars, max_tokens, param)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self.pool, self._encode_bounded, text, max_tokens, param,
                                             add_special_tokens)
        if len(ids) > max_tokens:
            _refuse(len(ids), max_tokens, param)
        return ids

    def _encode_bounded(self, text: str, max_tokens: int, param: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _COUNT_CHUNK_CHARS:
            counted = 0
            for cuts, start in enumerate(range(0, len(text), _COUNT_CHUNK_CHARS)):
                piece = text[start : start + _COUNT_CHUNK_CHARS]
                counted += len(self.tokenizer.encode(piece, add_special_tokens=False))
                # A cut can add up to two tokens (a word split in two, and sentencepiece's "▁" on the
                # new piece): only a count above that proves the text too long.
                if counted - 2 * cuts > max_tokens:
                    _refuse(counted - 2 * cuts, max_tokens, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        tool_prompt: str | None = None,
    ) -> str:
        """Render the model's own Jinja chat template (as transformers does). Continuing the final
        message means no new generation prompt is opened after it. Of `template_kwargs`, only the
        template's own variables reach it (as vLLM does): others could not change the text, and
        names the renderer sets itself (messages, bos_token, ...) are not replaced. `tools` go to the
        template; one that never reads them gets `tool_prompt` as (the start of) the system message."""
        if not self.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        check_nesting(template_kwargs, "chat_template_kwargs")
        known = self.template_variables
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in self.reserved_variables and (known is None or k in known)}
        messages = [_as_template_reads(message, self.template_reads_parts) for message in messages]
        if tools and known is not None and "tools" not in known and tool_prompt:
            messages = _with_system_text(messages, tool_prompt)
        elif tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **kwargs,
            )
        except Exception as err:  # a template's own raise_exception() or a malformed message
            raise ApiError(400, f"chat template failed: {err}", "messages") from err

    def skip_ids(self, kept: tuple[str, ...]) -> frozenset[int] | None:
        """The special tokens an answer drops when it keeps the marks of `kept` that are special tokens
        (Gemma 4's tool-call and thinking marks); None where none of them is one."""
        kept_ids = {self.added_vocab[text] for text in kept if text in self.added_vocab} & self.special_ids
        return self.special_ids - kept_ids if kept_ids else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        if isinstance(content, list):
            content = [{"type": "text", "text": text + "\n\n"}, *content]
        else:
            content = text + "\n\n" + content
        return [{**messages[0], "content": content}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def _as_template_reads(message: dict[str, Any], reads_parts: bool) -> dict[str, Any]:
    """Content given as text parts, as the template renders it: the parts themselves for a template
    that reads them (transformers hands it the list: Qwen2.5-VL's concatenates them), else one string
    joined by newlines (as vLLM does for a template that reads strings only)."""
    content = message.get("content")
    if reads_parts or not isinstance(content, list) or any(part.get("type") != "text" for part in content):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


_PROBE = "crane-mp-template-probe"


def _reads_text_parts(tokenizer: Any) -> bool:
    """Whether the chat template renders content given as a list of text parts: it shows the part's
    text and not the list itself (a template reading strings only prints the list's repr, renders
    nothing for it, or refuses it)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template's raise_exception() for content that is not a string
        return False
    return isinstance(text, str) and _PROBE in text and "'type'" not in text and '"type"' not in text


def _refuse(at_least: int, max_tokens: int, param: str) -> None:
    raise ApiError(400, f"{param} is too long: at least {at_least} tokens, more than the {max_tokens} this "
                        "model's context window can take", param)


_RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception"})


def writes_xml_calls(template: str | dict[str, str] | None) -> bool:
    """Whether the chat template renders tool calls as Qwen3-Coder's XML (`<function=...>` elements)."""
    sources = template.values() if isinstance(template, dict) else [template] if template else []
    return any("<function=" in source and "<parameter=" in source for source in sources)


def _template_variables(template: str | dict[str, str] | None) -> frozenset[str] | None:
    """Names a chat template (or each of a tokenizer's named templates) reads from its context; None
    when jinja2 alone cannot parse it (a template using transformers' own tags)."""
    sources = template.values() if isinstance(template, dict) else [template] if template else []
    env = Environment(extensions=["jinja2.ext.loopcontrols"])
    names = set()
    try:
        for source in sources:
            names |= meta.find_undeclared_variables(env.parse(source))
    except TemplateSyntaxError:
        return None
    return frozenset(names)
