"""SGLang's native generation API: /generate and /abort_request (by the client-chosen rid)."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from crane_mp.frontend.choices import admitted, collect, merged_deltas, open_choices, resolve_max_tokens
from crane_mp.frontend.errors import ApiError, error_body
from crane_mp.frontend.generation import Generation, GenerationError
from crane_mp.frontend.logprobs_format import scored_prompt_positions
from crane_mp.frontend.http import SSE_DONE, SSE_HEADERS, json_response, resolve_model, sse_event
from crane_mp.frontend.openai_schemas import decode_body, prompt_inputs, stop_strings
from crane_mp.frontend.sglang_schemas import AbortBody, SGLangGenerateRequest, SGLangSamplingParams
from crane_mp.frontend.state import STATE, FrontendState

routes = web.RouteTableDef()


async def _prompts(state: FrontendState, req: SGLangGenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids per prompt, and whether the request was a batch (answered with a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    limit = state.engine_info.max_model_len
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [await state.tokenizer.encode(t, limit - 1, "text") for t in texts], isinstance(req.text, list)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    return prompt_inputs(req.input_ids, state.engine_info.vocab_size, "input_ids"), batch


def _finish_reason(delta_reason: str | None, stop_reason, num_tokens: int) -> dict[str, Any] | None:
    if delta_reason is None:
        return None
    if delta_reason == "length":  # the budget ran out: max_new_tokens, or what the context window left
        return {"type": "length", "length": num_tokens}
    if delta_reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": "aborted"}


def _logprob_triples(values, ids, token_text, with_text):
    return [[v, i, token_text(i) if with_text else None] for v, i in zip(values, ids)]


def _logprob_info(state: FrontendState, req: SGLangGenerateRequest, gen: Generation, prompt: list[int],
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
    state.require_generative()
    req = decode_body(await request.read(), SGLangGenerateRequest)
    _, lora_id = resolve_model(state, req.model)
    sp = req.sampling_params or SGLangSamplingParams()
    prompts, batch = await _prompts(state, req)
    lora_ids = _lora_ids(state, req.lora_path, len(prompts), lora_id)
    # max_new_tokens=0 scores the input (with return_logprob): the engine still makes one token.
    max_tokens = [resolve_max_tokens(state, len(p), max(sp.max_new_tokens, 1), "input_ids") for p in prompts]
    logprobs = req.top_logprobs_num if req.return_logprob else None
    wants_input = req.return_logprob and req.logprob_start_len >= 0
    params = sp.to_sampling(state.engine_info.vocab_size, logprobs, req.top_logprobs_num if wants_input else None)
    params = await state.grammars.constrain(params, sp.constraint(), state.engine_info)
    names = _request_names(req.rid, len(prompts), sp.n)
    async with open_choices(state, prompts, sp.n, params, max_tokens, stop_strings(sp.stop), sp.skip_special_tokens,
                            discard_output=sp.max_new_tokens == 0, names=names, lora_ids=lora_ids) as gens:
        return await _generate_response(request, req, sp, prompts, batch, names, gens)


def _lora_ids(state: FrontendState, lora_path: str | list[str | None] | None, num_prompts: int,
              default: int) -> list[int]:
    """Each prompt's adapter: SGLang's lora_path names a --lora-modules adapter (one for all, or one per
    prompt; null: the base model); without it, the one `model` named."""
    if lora_path is None:
        return [default] * num_prompts
    paths = [lora_path] * num_prompts if isinstance(lora_path, str) else list(lora_path)
    if len(paths) != num_prompts:
        raise ApiError(400, f"lora_path lists {len(paths)} adapters for {num_prompts} prompts", "lora_path")
    ids = []
    for path in paths:
        adapter = None if path is None else state.adapters.get(path)
        if path is not None and adapter is None:
            raise ApiError(400, f"lora_path {path!r} is not a loaded adapter (--lora-modules); loaded: "
                                f"{', '.join(state.adapters) or 'none'}", "lora_path")
        ids.append(0 if adapter is None else adapter.lora_id)
    return ids


def _request_names(rid: str | list[str] | None, num_prompts: int, n: int) -> list[str]:
    """The client's name of each generation (prompt i's samples share rid[i]); generated where none."""
    per_prompt = [rid] * num_prompts if isinstance(rid, str) else list(rid or [])[:num_prompts]
    per_prompt += [uuid.uuid4().hex for _ in range(num_prompts - len(per_prompt))]
    return [name for name in per_prompt for _ in range(n)]


async def _generate_response(request, req: SGLangGenerateRequest, sp: SGLangSamplingParams, prompts, batch: bool,
                             names: list[str], gens: list[Generation]) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.monotonic()

    def result(index: int, text: str, ids: list[int], logprobs_list, finish) -> dict[str, Any]:
        gen = gens[index]
        meta = {"id": names[index], "prompt_tokens": gen.prompt_tokens, "completion_tokens": len(ids),
                "cached_tokens": gen.cached_tokens, "finish_reason": finish,
                "e2e_latency": round(time.monotonic() - started, 6)}
        if req.return_logprob:
            meta.update(_logprob_info(state, req, gen, prompts[index // sp.n], ids, logprobs_list))
        body = {"text": text, "output_ids": ids, "meta_info": meta}
        if batch or sp.n > 1:
            body["index"] = index
        return body

    if req.stream:
        return await _stream(request, gens, result)
    outs = await collect(gens)
    bodies = [result(i, o.text, o.token_ids, o.logprobs, _finish_reason(o.finish_reason, o.stop_reason, len(o.token_ids)))
              for i, o in enumerate(outs)]
    return json_response(bodies if batch or sp.n > 1 else bodies[0])


async def _stream(request: web.Request, gens: list[Generation], result) -> web.StreamResponse:
    """SGLang's framing: every chunk carries the output so far (text and ids), then [DONE]."""
    await admitted(gens)
    response = web.StreamResponse(headers=SSE_HEADERS)
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
                finish = _finish_reason(delta.finish_reason, delta.stop_reason, len(ids[index]))
                payload = result(index, texts[index], ids[index], logprobs[index], finish)
                await response.write(sse_event(payload))
    except GenerationError as err:
        await response.write(sse_event(error_body(err.status, str(err))))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    """Abort by the client's name for a request: an SGLang rid, an OpenAI response id (chatcmpl-...,
    cmpl-...) or an X-Request-Id, whichever frontend serves it. Unknown or finished ones are a no-op
    success."""
    state = request.app[STATE]
    state.require_ready()
    body = decode_body(await request.read(), AbortBody)
    await state.client.abort_named(body.rid)
    return json_response({"success": True, "rid": body.rid})
