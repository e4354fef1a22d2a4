"""/v1/embeddings: each input runs through the scheduler as a prompt-only request whose worker step
returns the pooled final hidden state (--pooling) instead of a token; batched with everything else.
Texts are tokenized as the checkpoint's sentence-transformers configuration does it (pooling.py)."""

from __future__ import annotations

import uuid

from aiohttp import web

from crane_mp.frontend.openai.bodies import embedding_item
from crane_mp.frontend.openai.schemas import MAX_EMBEDDING_INPUTS, EmbeddingRequest, prompt_inputs
from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Generation
from crane_mp.frontend.serving.pipeline import Plan, prompt_ids, serve
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.protocol import SamplingParams

api = RouteTable()


@api.add("post", "/v1/embeddings", body=EmbeddingRequest, requires=FrontendState.require_embedding,
         generation=True, errors=GENERATION_ERRORS, summary="Embeddings (servers started with --task embed)")
async def embeddings(request: web.Request, req: EmbeddingRequest) -> web.StreamResponse:
    state = request.app[STATE]
    model, lora_id = await resolve_model(state, req.model)
    info = state.engine_info
    if req.dimensions is not None and req.dimensions > info.hidden_size:
        raise ApiError(400, f"dimensions must be at most this model's {info.hidden_size}", "dimensions")
    prompts = [await _input_ids(state, item)
               for item in prompt_inputs(req.input, info.vocab_size, "input", MAX_EMBEDDING_INPUTS)]
    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=state.config.pooling.method, lora_id=lora_id)
    plan = Plan(prompts, params, 0, "input", names=f"embd-{uuid.uuid4().hex}")  # the prompt alone: no output

    def render(gens: list[Generation]):
        def body(_: list[Collected]) -> dict:
            vectors = [gen.embedding for gen in gens]
            if any(v is None for v in vectors):
                raise ApiError(500, "the engine finished an embedding request without its vector")
            normalize = state.config.pooling.normalize
            data = [embedding_item(i, v, normalize, req.dimensions, req.encoding_format) for i, v in enumerate(vectors)]
            prompt_tokens = sum(gen.prompt_tokens for gen in gens)
            return {"object": "list", "data": data, "model": model,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

        return body

    return await serve(request, state, plan, render)


async def _input_ids(state: FrontendState, item: str | list[int]) -> list[int]:
    """One input's token ids, as sentence-transformers makes them for this checkpoint: a text of a
    checkpoint saved with the message modality is a user message in the model's chat template."""
    if isinstance(item, str) and state.config.pooling.chat_template:
        text = state.tokenizer.render_chat([{"role": "user", "content": item}], False, False, None)
        return await prompt_ids(state, text, "input", add_special_tokens=False)
    return await prompt_ids(state, item, "input")
