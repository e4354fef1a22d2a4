"""/v1/embeddings: each input runs through the scheduler as a prompt-only request whose worker step
returns the pooled final hidden state (--pooling) instead of a token; batched with everything else."""

from __future__ import annotations

import uuid

from aiohttp import web

from crane_mp.frontend.choices import collect, open_choices, resolve_max_tokens
from crane_mp.frontend.errors import ApiError
from crane_mp.frontend.http import json_response, resolve_model
from crane_mp.frontend.openai_responses import embedding_item
from crane_mp.frontend.openai_schemas import MAX_EMBEDDING_INPUTS, EmbeddingRequest, decode_body, prompt_inputs
from crane_mp.frontend.state import STATE
from crane_mp.protocol import SamplingParams

routes = web.RouteTableDef()


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    if state.config.engine.task != "embed":
        raise ApiError(400, "this server generates text; serve an embedding model with --task embed")
    req = decode_body(await request.read(), EmbeddingRequest)
    model, lora_id = resolve_model(state, req.model)
    info = state.engine_info
    if req.dimensions is not None and req.dimensions > info.hidden_size:
        raise ApiError(400, f"dimensions must be at most this model's {info.hidden_size}", "dimensions")
    prompts = []
    for item in prompt_inputs(req.input, info.vocab_size, "input", MAX_EMBEDDING_INPUTS):
        prompts.append(await state.tokenizer.encode(item, info.max_model_len - 1, "input")
                       if isinstance(item, str) else item)
    budgets = [resolve_max_tokens(state, len(p), 1, "input") for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=state.config.pooling.method, lora_id=lora_id)
    async with open_choices(state, prompts, 1, params, budgets, [], True, discard_output=True,
                            names=f"embd-{uuid.uuid4().hex}") as gens:
        await collect(gens)
        vectors = [gen.embedding for gen in gens]
        prompt_tokens = sum(gen.prompt_tokens for gen in gens)
    if any(v is None for v in vectors):
        raise ApiError(500, "the engine finished an embedding request without its vector")
    normalize = state.config.pooling.normalize
    data = [embedding_item(i, v, normalize, req.dimensions, req.encoding_format) for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
