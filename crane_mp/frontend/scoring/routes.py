"""/v1/rerank (Cohere's and Jina's shape; /rerank and /v2/rerank too) and /score (vLLM's text_1 / text_2;
/v1/score too), for sequence-classification checkpoints (--task score: sentence-transformers'
CrossEncoder's models; the head in score_head.py) and for Qwen3-Reranker-style models on a generating
server: a causal LM asked whether a document meets a query, scored by its own recipe, p(yes) /
(p(yes) + p(no)) for the next token after the reranker's prompt.

Each pair is prompted as Qwen3-Reranker's reference code prompts it (its system text, the
instruction, query and document, then an empty think block), with its three parts tokenized apart
as that code does. The engine pools the prompt's last final hidden state, and the head made of the
"yes" and "no" rows of the LM head (score_head.answer_head) turns it into the yes/no logit difference
the recipe's two-way softmax reads: one request per pair, whose shared prompt prefix (system text,
instruction, query) the prefix cache serves from the second document on.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

import msgspec
from aiohttp import web

from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Generation
from crane_mp.frontend.serving.pipeline import Plan, prompt_ids, serve
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.models.gguf_file import resolve_model_source
from crane_mp.models.score_head import ScoreHead, answer_head
from crane_mp.protocol import SamplingParams

api = RouteTable()
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The model sglang-router names in every rerank request it forwards, whatever its client named: the
# served one.
_ROUTER_UNNAMED = "unknown"
# Documents a request may score (also bounded by --max-request-generations: a pair is one engine request).
MAX_DOCUMENTS = 1024


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Annotated[list[str | RerankDocument], msgspec.Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    model: str | None = None
    top_n: Annotated[int, msgspec.Meta(ge=1, le=MAX_DOCUMENTS)] | None = None
    return_documents: bool = True
    # The reranker's task text: Qwen3-Reranker's "Instruct", a CrossEncoder's prompt (its default where none)
    instruction: str | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    text_2: str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    model: str | None = None
    instruction: str | None = None


def _answer_tokens(state: FrontendState) -> tuple[int, int]:
    token_id = state.tokenizer.tokenizer.backend_tokenizer.token_to_id
    yes, no = token_id("yes"), token_id("no")
    if yes is None or no is None:
        raise ApiError(400, "this model's vocabulary has no single `yes` and `no` tokens: it is not a "
                            "Qwen3-Reranker-style model, which rerank and score need")
    return yes, no


async def _score_pairs(request: web.Request, pairs: list[tuple[str, str]], instruction: str | None, model: str | None,
                       respond) -> web.StreamResponse:
    """Score every (query, document) pair and answer with `respond(scores, prompt tokens)`: each pair's
    last token's final hidden state is pooled by the engine, the head applied here (score_head.py)."""
    state = request.app[STATE]
    _, lora_id = await resolve_model(state, model)
    prompts = []
    if state.score_head is not None:
        head = state.score_head
        for index, (query, document) in enumerate(pairs):
            ids = head.pooled_ids(await _classified_pair_ids(state, query, document, instruction or head.prompt))
            _check_room(state, index, len(ids))
            prompts.append(ids)
    else:
        head = await _reranker_head(state)
        encode = state.tokenizer.tokenizer.encode
        prefix, suffix = encode(_PREFIX, add_special_tokens=False), encode(_SUFFIX, add_special_tokens=False)
        room = state.engine_info.max_model_len - 1 - len(prefix) - len(suffix)  # and the pooled step
        for query, document in pairs:
            body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            prompts.append(prefix + await state.tokenizer.encode(body, room, "documents", add_special_tokens=False)
                           + suffix)
    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=head.pooling, lora_id=lora_id)
    plan = Plan(prompts, params, 0, "documents", names=f"score-{uuid.uuid4().hex}")

    def render(gens: list[Generation]):
        def body(_: list[Collected]) -> Any:
            if any(gen.embedding is None for gen in gens):
                raise ApiError(500, "the engine finished a scoring request without its hidden state")
            return respond([head.score(gen.embedding) for gen in gens], sum(map(len, prompts)))

        return body

    return await serve(request, state, plan, render)


async def _reranker_head(state: FrontendState) -> ScoreHead:
    """The served causal reranker's yes/no head, read from the model file once (two LM-head rows)."""
    if state.answer_head is None:
        yes, no = _answer_tokens(state)
        engine = state.config.engine
        source = resolve_model_source(engine.model_path, engine.model_format)
        state.answer_head = await asyncio.get_running_loop().run_in_executor(
            state.tokenizer.pool, answer_head, source, yes, no)
    return state.answer_head


async def _classified_pair_ids(state: FrontendState, query: str, document: str, prompt: str | None) -> list[int]:
    """A pair's tokens as CrossEncoder makes them: query and document messages through the chat
    template (after `prompt` as a system message), else the tokenizer's text-pair encoding (`prompt`
    before the query) cut to the tokenizer's and the engine's limit."""
    head = state.score_head
    if head.pair_format is None:  # cut to fit, the longer text first, as CrossEncoder cuts a pair
        tokenizer = state.tokenizer.tokenizer
        limit = min(tokenizer.model_max_length, state.engine_info.max_model_len - 1)
        return tokenizer((prompt or "") + query, document, truncation="longest_first", max_length=limit)["input_ids"]
    structured = head.pair_format == "structured"
    turns = ((("system", prompt),) if prompt else ()) + (("query", query), ("document", document))
    messages = [{"role": role, "content": [{"type": "text", "text": text}] if structured else text}
                for role, text in turns]
    rendered = state.tokenizer.render_chat(messages, False, False, None)
    if query not in rendered or document not in rendered:
        raise ApiError(400, "this model's chat template drops the query or the document of a pair (roles `query` and "
                            "`document`); sentence-transformers refuses such a template too", "documents")
    return await prompt_ids(state, rendered, "documents", add_special_tokens=False)


def _check_room(state: FrontendState, index: int, tokens: int) -> None:
    if tokens > state.engine_info.max_model_len:
        raise ApiError(400, f"pair {index} takes {tokens} tokens; the context window holds "
                            f"{state.engine_info.max_model_len}", "documents")


@api.add("post", "/v1/rerank", body=RerankRequest, requires=FrontendState.require_scoring, generation=True,
         errors=GENERATION_ERRORS, summary="Rerank documents for a query (Cohere/Jina shape)")
@api.add("post", "/rerank", body=RerankRequest, requires=FrontendState.require_scoring, generation=True)
@api.add("post", "/v2/rerank", body=RerankRequest, requires=FrontendState.require_scoring, generation=True)
async def rerank(request: web.Request, req: RerankRequest) -> web.StreamResponse:
    texts = [doc if isinstance(doc, str) else doc.text for doc in req.documents]
    model = None if req.model == _ROUTER_UNNAMED else req.model
    model_name = (await resolve_model(request.app[STATE], model))[0]

    def respond(scores: list[float], tokens: int) -> dict[str, Any]:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model_name, "usage": {"total_tokens": tokens},
                "results": results}

    return await _score_pairs(request, [(req.query, text) for text in texts], req.instruction, model, respond)


@api.add("post", "/score", body=ScoreRequest, requires=FrontendState.require_scoring, generation=True,
         errors=GENERATION_ERRORS, summary="Score text pairs (vLLM's text_1 / text_2)")
@api.add("post", "/v1/score", body=ScoreRequest, requires=FrontendState.require_scoring, generation=True)
async def score(request: web.Request, req: ScoreRequest) -> web.StreamResponse:
    """text_1 one text and text_2 several: each against the one; two lists: pair by pair."""
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                            "as text_2", "text_1")
    model_name = (await resolve_model(request.app[STATE], req.model))[0]

    def respond(scores: list[float], tokens: int) -> dict[str, Any]:
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_name,
                "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await _score_pairs(request, list(zip(first, second)), req.instruction, req.model, respond)
