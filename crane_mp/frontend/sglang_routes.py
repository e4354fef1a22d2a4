"""SGLang's native generation API: /generate and /abort_request (by the client-chosen rid)."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from crane_mp.frontend.choices import check_context, collect, merged_deltas, start_choices
from crane_mp.frontend.errors import ApiError, error_body
from crane_mp.frontend.generation import Generation, GenerationError
from crane_mp.frontend.logprobs_format import scored_prompt_positions
from crane_mp.frontend.openai_routes import json_response
from crane_mp.frontend.openai_schemas import decode_body, sampling_params
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.protocol import SamplingParams

routes = web.RouteTableDef()
_json = msgspec.json.Encoder()


class SGLangSamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's own name for seed
    n: int = 1

    # The OpenAI-side validator reads these names.
    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens

    @property
    def logit_bias(self) -> None:
        return None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # one prompt's ids, or a batch of them
    sampling_params: SGLangSamplingParams | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    model: str | None = None


class AbortBody(msgspec.Struct, kw_only=True):
    rid: str = ""


async def _prompts(state: FrontendState, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids per prompt, and whether the request was a batch (answered with a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [await state.tokenizer.encode(t) for t in texts], isinstance(req.text, list)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    prompts = req.input_ids if batch else [req.input_ids]
    if any(not isinstance(p, list) or any(not isinstance(t, int) for t in p) for p in prompts):
        raise ApiError(400, "input_ids must be a list of ids or a list of such lists", "input_ids")
    vocab = state.engine_info.vocab_size
    if any(not p or any(not 0 <= t < vocab for t in p) for p in prompts):
        raise ApiError(400, f"input_ids must be non-empty lists of ids in [0, {vocab})", "input_ids")
    return [list(p) for p in prompts], batch


def _finish_reason(delta_reason: str | None, stop_reason, max_new_tokens: int) -> dict[str, Any] | None:
    if delta_reason is None:
        return None
    if delta_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    if delta_reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": "aborted"}


def _logprob_triples(values, ids, token_text, with_text):
    return [[v, i, token_text(i) if with_text else None] for v, i in zip(values, ids)]


def _logprob_info(state: FrontendState, req: GenerateRequest, gen: Generation, prompt: list[int],
                  output_ids: list[int], output_logprobs) -> dict[str, Any]:
    token_text, with_text = state.tokenizer.token_text, req.return_text_in_logprobs
    start = max(0, req.logprob_start_len) if req.logprob_start_len >= 0 else len(prompt)
    scored = scored_prompt_positions(gen.prompt_logprobs)
    input_lp, input_top = [], []
    for pos in range(start, len(prompt)):
        value, top_ids, top_values = scored.get(pos, (None, [], []))
        input_lp.append([value, prompt[pos], token_text(prompt[pos]) if with_text else None])
        input_top.append(_logprob_triples(top_values, top_ids, token_text, with_text) if value is not None else None)
    output_lp, output_top = [], []
    for token_id, lp in zip(output_ids, output_logprobs):
        output_lp.append([lp.logprob if lp else None, token_id, token_text(token_id) if with_text else None])
        output_top.append(_logprob_triples(lp.top_logprobs, lp.top_token_ids, token_text, with_text) if lp else [])
    info = {"input_token_logprobs": input_lp, "output_token_logprobs": output_lp}
    if req.top_logprobs_num:
        info.update(input_top_logprobs=input_top, output_top_logprobs=output_top)
    return info


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_ready()
    req = decode_body(await request.read(), GenerateRequest)
    sp = req.sampling_params or SGLangSamplingParams()
    if req.top_logprobs_num < 0 or req.top_logprobs_num > 20:
        raise ApiError(400, "top_logprobs_num must be between 0 and 20", "top_logprobs_num")
    prompts, batch = await _prompts(state, req)
    for prompt in prompts:
        check_context(state, len(prompt), sp.max_new_tokens, "input_ids")
    if sp.max_new_tokens < 1:
        raise ApiError(400, "max_new_tokens must be at least 1", "sampling_params")
    logprobs = req.top_logprobs_num if req.return_logprob else None
    wants_input = req.return_logprob and req.logprob_start_len >= 0
    stop = [sp.stop] if isinstance(sp.stop, str) else [s for s in (sp.stop or []) if s]
    seeded = msgspec.structs.replace(sp, seed=sp.seed if sp.seed is not None else sp.sampling_seed)
    params: SamplingParams = sampling_params(
        seeded, sp.max_new_tokens, state.engine_info.vocab_size, logprobs, req.top_logprobs_num if wants_input else None
    )
    rids = [req.rid] if isinstance(req.rid, str) else (req.rid or [])
    if rids and len(rids) != len(prompts):
        raise ApiError(400, "rid must be one id per prompt", "rid")
    gens = await start_choices(state, prompts, sp.n, params, stop, sp.skip_special_tokens)
    names = [rids[i // sp.n] if rids else uuid.uuid4().hex for i in range(len(gens))]
    for name, gen in zip(names, gens):
        state.sglang_rids.setdefault(name, []).append(gen.rid)
    started = time.monotonic()

    def result(index: int, text: str, ids: list[int], logprobs_list, finish) -> dict[str, Any]:
        gen = gens[index]
        # cached_tokens stays 0 until prefix caching exists.
        meta = {"id": names[index], "prompt_tokens": gen.prompt_tokens, "completion_tokens": len(ids),
                "cached_tokens": 0, "finish_reason": finish, "e2e_latency": round(time.monotonic() - started, 6)}
        if req.return_logprob:
            meta.update(_logprob_info(state, req, gen, prompts[index // sp.n], ids, logprobs_list))
        body = {"text": text, "output_ids": ids, "meta_info": meta}
        if batch or sp.n > 1:
            body["index"] = index
        return body

    try:
        if req.stream:
            return await _stream(request, gens, result, sp.max_new_tokens)
        outs = await collect(gens)
        bodies = [result(i, o.text, o.token_ids, o.logprobs,
                         _finish_reason(o.finish_reason, o.stop_reason, sp.max_new_tokens))
                  for i, o in enumerate(outs)]
        return json_response(bodies if batch or sp.n > 1 else bodies[0])
    finally:
        for name in set(names):
            state.sglang_rids.pop(name, None)


async def _stream(request: web.Request, gens: list[Generation], result, max_new_tokens: int) -> web.StreamResponse:
    """SGLang's framing: every chunk carries the output so far (text and ids), then [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    texts = [""] * len(gens)
    ids: list[list[int]] = [[] for _ in gens]
    logprobs: list[list] = [[] for _ in gens]
    try:
        async with aclosing(merged_deltas(gens)) as deltas:
            async for index, delta in deltas:
                texts[index] += delta.text
                ids[index] += delta.token_ids
                logprobs[index] += delta.logprobs
                finish = _finish_reason(delta.finish_reason, delta.stop_reason, max_new_tokens)
                payload = result(index, texts[index], ids[index], logprobs[index], finish)
                await response.write(b"data: " + _json.encode(payload) + b"\n\n")
    except GenerationError as err:
        await response.write(b"data: " + _json.encode(error_body(503, str(err))) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    """Abort by the client-chosen rid; unknown or finished ids are a no-op success."""
    state = request.app[STATE]
    body = decode_body(await request.read(), AbortBody)
    for rid in state.sglang_rids.get(body.rid, []):
        await state.client.abort(rid, keep_stream=True)
    return json_response({"success": True, "rid": body.rid})
