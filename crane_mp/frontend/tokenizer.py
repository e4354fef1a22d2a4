"""Tokenizer and chat template of the served model (frontend only).

Long prompts are encoded in a worker thread: the fast tokenizers release the GIL, so the event loop
keeps serving while they run.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import AutoTokenizer

from crane_mp.frontend.errors import ApiError
from crane_mp.frontend.logprobs_format import TokenText

# Below this many characters encoding is faster than a thread hand-off.
_INLINE_CHARS = 2048


class TokenizerService:
    def __init__(self, model_path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.backend = self.tokenizer._tokenizer  # the `tokenizers` object DecodeStream needs
        self.token_text = TokenText(self.tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        """Render the model's own Jinja chat template (as transformers does). Continuing the final
        message means no new generation prompt is opened after it."""
        if not self.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(template_kwargs or {}),
            )
        except Exception as err:  # a template's own raise_exception() or a malformed message
            raise ApiError(400, f"chat template failed: {err}", "messages") from err

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
