"""/tokenize and /detokenize in vLLM's shapes (also under /v1/, and accepting crane-oai's `text`)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from crane_mp.frontend.openai.schemas import ChatMessage, chat_messages
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.fields import TokenId
from crane_mp.frontend.web.http import check_model, json_response
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable

api = RouteTable()


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of prompt, text or messages (openapi.py states it with fields.exactly_one_of)."""

    model: str | None = None
    prompt: str | None = None
    text: str | None = None  # crane-oai's name for prompt
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# Ready first: the context window bounds how much text is tokenized.
@api.add("post", "/tokenize", body=TokenizeRequest, requires=FrontendState.require_ready)
@api.add("post", "/v1/tokenize", body=TokenizeRequest, requires=FrontendState.require_ready, errors=GENERATION_ERRORS,
         summary="Text or chat messages to token ids")
async def tokenize(request: web.Request, req: TokenizeRequest) -> web.Response:
    state = request.app[STATE]
    await check_model(state, req.model)
    sources = [x is not None for x in (req.prompt, req.text, req.messages)]
    if sum(sources) != 1:
        raise ApiError(400, "give exactly one of prompt, text or messages", "prompt")
    limit = state.engine_info.max_model_len
    if req.messages is not None:
        text = state.tokenizer.render_chat(
            chat_messages(req.messages), req.add_generation_prompt, req.continue_final_message,
            req.chat_template_kwargs,
        )
        # The template already wrote the special tokens it wants.
        tokens = await state.tokenizer.encode(text, limit, "messages", add_special_tokens=bool(req.add_special_tokens))
    else:
        text = req.prompt if req.prompt is not None else req.text
        tokens = await state.tokenizer.encode(text, limit, "prompt", add_special_tokens=req.add_special_tokens is not False)
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": limit})


@api.add("post", "/detokenize", body=DetokenizeRequest)
@api.add("post", "/v1/detokenize", body=DetokenizeRequest, errors=("400", "404", "413"), summary="Token ids to text")
async def detokenize(request: web.Request, req: DetokenizeRequest) -> web.Response:
    state = request.app[STATE]
    await check_model(state, req.model)
    # The model's vocabulary, as /openapi.json states it (ids past the tokenizer's own decode to nothing).
    vocab = state.engine_info.vocab_size if state.engine_info else len(state.tokenizer.tokenizer)
    if any(t >= vocab for t in req.tokens):
        raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens")
    text = state.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return json_response({"prompt": text, "text": text})
