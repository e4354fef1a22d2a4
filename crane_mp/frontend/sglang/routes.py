"""SGLang's native generation API: /generate and /abort_request (by the client-chosen rid)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from crane_mp.frontend.images.chat import check_takes_images, load_images, place_images, record_images
from crane_mp.frontend.openai.schemas import prompt_inputs, stop_strings
from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Delta, Generation
from crane_mp.frontend.serving.logprobs_format import scored_prompt_positions
from crane_mp.frontend.serving.pipeline import Plan, prompt_ids, serve
from crane_mp.frontend.serving.reasoning import (
    LEADING,
    PARSER_MARKERS,
    THINK,
    THINKING,
    prompt_opens_thinking,
    split_reasoning,
)
from crane_mp.frontend.sglang.schemas import (
    AbortBody,
    SeparateReasoningRequest,
    SGLangGenerateRequest,
    SGLangSamplingParams,
)
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import json_response, resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.protocol import MediaInput

api = RouteTable()


async def _prompts(state: FrontendState, req: SGLangGenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids per prompt, and whether the request was a batch (answered with a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [await prompt_ids(state, t, "text") for t in texts], isinstance(req.text, list)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    return prompt_inputs(req.input_ids, state.engine_info.vocab_size, "input_ids"), batch


async def _images(state: FrontendState, req: SGLangGenerateRequest, prompts: list[list[int]],
                  batch: bool) -> list[MediaInput] | None:
    """image_data read and placed at the prompt's image tokens (each expanded to its patches in place)."""
    if not req.image_data:
        return None
    data = [req.image_data] if isinstance(req.image_data, str) else req.image_data
    if batch:
        raise ApiError(400, "image_data goes with a single prompt, not a batch", "image_data")
    check_takes_images(state, len(data), "image_data")
    images = await load_images(state, [(f"image_data[{i}]", _image_url(value, f"image_data[{i}]"))
                                       for i, value in enumerate(data)])
    prompts[0], media = place_images(state, prompts[0], images, "image_data")
    record_images(state, len(images))
    return media


def _image_url(value: str, where: str) -> str:
    """An image_data entry as a URL: SGLang's bare base64 bytes become a data: URL; local paths are not read."""
    if value.startswith(("data:", "http://", "https://")):
        return value
    if value.startswith(("/", "file:", "./", "~")):
        raise ApiError(400, f"{where}: this server reads no local files; send an http(s) or data: URL, or the "
                            "image's bytes in base64", "image_data")
    return "data:image/*;base64," + value


def _finish_reason(delta_reason: str | None, stop_reason, num_tokens: int) -> dict[str, Any] | None:
    if delta_reason is None:
        return None
    if delta_reason == "length":  # the budget ran out: max_new_tokens, or what the context window left
        return {"type": "length", "length": num_tokens}
    if delta_reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": "aborted"}


class LogprobInfo:
    """One generation's meta_info logprob lists. A stream's every chunk carries them whole (SGLang's
    framing), so they are extended by each chunk's new tokens, never rebuilt: the prompt's once, on
    the first chunk (prefill has scored it all by then), the output's token by token."""

    def __init__(self, state: FrontendState, req: SGLangGenerateRequest, gen: Generation, prompt: list[int]) -> None:
        self.token_text, self.with_text = state.tokenizer.token_text, req.return_text_in_logprobs
        self.top = bool(req.top_logprobs_num)
        self.req, self.gen, self.prompt = req, gen, prompt
        self.lists: dict[str, list] | None = None

    def info(self, output_ids: list[int], output_logprobs) -> dict[str, Any]:
        if self.lists is None:
            self.lists = {**self._input(), "output_token_logprobs": [], "output_top_logprobs": []}
        output_lp, output_top = self.lists["output_token_logprobs"], self.lists["output_top_logprobs"]
        for token_id, lp in zip(output_ids[len(output_lp):], output_logprobs[len(output_lp):]):
            output_lp.append([lp.logprob if lp else None, token_id, self._text(token_id)])
            output_top.append(self._triples(lp.top_logprobs, lp.top_token_ids) if lp else [])
        if self.top:
            return self.lists
        return {key: self.lists[key] for key in ("input_token_logprobs", "output_token_logprobs")}

    def _input(self) -> dict[str, list]:
        prompt, start = self.prompt, self.req.logprob_start_len
        start = max(0, start) if start >= 0 else len(prompt)
        scored = scored_prompt_positions(self.gen.prompt_logprobs)
        input_lp, input_top = [], []
        for pos in range(start, len(prompt)):
            value, top_ids, top_values = scored.get(pos, (None, [], []))
            input_lp.append([value, prompt[pos], self._text(prompt[pos])])
            input_top.append(self._triples(top_values, top_ids) if value is not None else None)
        return {"input_token_logprobs": input_lp, "input_top_logprobs": input_top}

    def _text(self, token_id: int) -> str | None:
        return self.token_text(token_id) if self.with_text else None

    def _triples(self, values, ids) -> list:
        return [[v, i, self._text(i)] for v, i in zip(values, ids)]


@api.add("post", "/generate", body=SGLangGenerateRequest, requires=FrontendState.require_generative,
         generation=True, errors=GENERATION_ERRORS, summary="SGLang native generation (SSE when stream=true)")
async def generate(request: web.Request, req: SGLangGenerateRequest) -> web.StreamResponse:
    state = request.app[STATE]
    _, lora_id = await resolve_model(state, req.model)
    sp = req.sampling_params or SGLangSamplingParams()
    prompts, batch = await _prompts(state, req)
    media = await _images(state, req, prompts, batch)
    lora_ids = _lora_ids(state, req.lora_path, len(prompts), lora_id)
    logprobs = req.top_logprobs_num if req.return_logprob else None
    wants_input = req.return_logprob and req.logprob_start_len >= 0
    params = sp.to_sampling(state.engine_info.vocab_size, logprobs, req.top_logprobs_num if wants_input else None)
    params = await state.grammars.constrain(params, sp.constraint(), state.engine_info)
    names = _request_names(req.rid, len(prompts), sp.n)
    # max_new_tokens=0 scores the input (with return_logprob).
    plan = Plan(prompts, params, sp.max_new_tokens, "input_ids", sp.n, stop_strings(sp.stop), sp.skip_special_tokens,
                names=names, lora_ids=lora_ids, media=media)
    started = time.monotonic()
    logprob_infos: dict[int, LogprobInfo] = {}
    # SGLang's reading: a raw prompt's answer thinks from its start only where the prompt opened thinking.
    modes = [THINKING if prompt_opens_thinking(t, state.think_markers) else LEADING
             for t in await _prompt_texts(state, req, prompts)] \
        if req.separate_reasoning else []

    def result(gens: list[Generation], index: int, text: str, ids: list[int], logprobs_list, finish) -> dict[str, Any]:
        gen = gens[index]
        meta = {"id": names[index], "prompt_tokens": gen.prompt_tokens, "completion_tokens": len(ids),
                "cached_tokens": gen.cached_tokens, "finish_reason": finish,
                "e2e_latency": round(time.monotonic() - started, 6)}
        if state.config.engine.speculative_method is not None:  # SGLang's: completion_tokens / it, tokens a step
            meta["spec_verify_ct"] = gen.stream.steps
        if req.return_logprob:
            if index not in logprob_infos:
                logprob_infos[index] = LogprobInfo(state, req, gen, prompts[index // sp.n])
            meta.update(logprob_infos[index].info(ids, logprobs_list))
        body = {"text": text, "output_ids": ids, "meta_info": meta}
        if req.separate_reasoning:  # a stream's chunks split the output so far, as a whole answer is split
            reasoning, body["text"] = split_reasoning(modes[index // sp.n], text, state.think_markers)
            body["reasoning_text"] = reasoning or ""
        if batch or sp.n > 1:
            body["index"] = index
        return body

    def render(gens: list[Generation]):
        if req.stream:
            return SGLangStream(len(gens), lambda *args: result(gens, *args))

        def body(outs: list[Collected]) -> Any:
            bodies = [result(gens, i, o.text, o.token_ids, o.logprobs,
                             _finish_reason(o.finish_reason, o.stop_reason, len(o.token_ids)))
                      for i, o in enumerate(outs)]
            return bodies if batch or sp.n > 1 else bodies[0]

        return body

    return await serve(request, state, plan, render)


async def _prompt_texts(state: FrontendState, req: SGLangGenerateRequest, prompts: list[list[int]]) -> list[str]:
    if req.text is not None:
        return [req.text] if isinstance(req.text, str) else list(req.text)
    return [state.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


@api.add("post", "/separate_reasoning", body=SeparateReasoningRequest, summary="Split a text into thinking and answer")
async def separate_reasoning(request: web.Request, req: SeparateReasoningRequest) -> web.Response:
    """SGLang's native endpoint: {"reasoning_text", "text"} of a whole answer."""
    text = req.text
    opened = req.reasoning_parser in ("deepseek-r1", "deepseek_r1", "qwen3-thinking")
    markers = PARSER_MARKERS.get((req.reasoning_parser or "").replace("-", "_"), THINK)
    if opened and text.lstrip().startswith(markers.start):  # R1-0528 writes the tag the template also opened
        text = text.lstrip()[len(markers.start):]
    reasoning, content = split_reasoning(THINKING if opened else LEADING, text, markers)
    return json_response({"reasoning_text": reasoning or "", "text": content})


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


@dataclass(slots=True)
class SGLangStream:
    """SGLang's framing: every chunk carries the output so far (text and ids)."""

    count: int
    result: Callable[..., dict[str, Any]]
    texts: list[str] = field(init=False)
    ids: list[list[int]] = field(init=False)
    logprobs: list[list] = field(init=False)

    def __post_init__(self) -> None:
        self.texts = [""] * self.count
        self.ids = [[] for _ in range(self.count)]
        self.logprobs = [[] for _ in range(self.count)]

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        self.texts[index] += delta.text
        self.ids[index] += delta.token_ids
        self.logprobs[index] += delta.logprobs
        finish = _finish_reason(delta.finish_reason, delta.stop_reason, len(self.ids[index]))
        return [self.result(index, self.texts[index], self.ids[index], self.logprobs[index], finish)]

    def closing(self) -> list[dict[str, Any]]:
        return []


@api.add("post", "/abort_request", body=AbortBody, requires=FrontendState.require_ready, errors=("400", "413"),
         admin=True, summary="Abort a /generate request by its rid")
async def abort_request(request: web.Request, body: AbortBody) -> web.Response:
    """Abort by the client's name for a request: an SGLang rid, an OpenAI response id (chatcmpl-...,
    cmpl-...) or an X-Request-Id, whichever frontend serves it. Unknown or finished ones are a no-op
    success."""
    await request.app[STATE].client.abort_named(body.rid)
    return json_response({"success": True, "rid": body.rid})
