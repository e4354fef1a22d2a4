"""Structured output in the frontend: a request's constraint (JSON schema, JSON object, regex, choice,
EBNF/GBNF or Lark grammar) -> a grammar in llguidance's form, validated against the served vocabulary.

Validation runs on a thread of its own (a large schema takes a fraction of a second, a pathological
one longer; llguidance releases the GIL, so the event loop goes on) within --grammar-timeout, and its
result is cached by constraint, so a schema sent with every request is checked once. The thread runs
at the lowest CPU priority (priority.py). A constraint's
text is at most _MAX_SOURCE_CHARS; JSON schemas get their open numbers bounded (json_bounds.py). The worker builds the same matcher from the text, beside its step
loop, before the request is scheduled (worker/step/background.py); an invalid constraint is a 400 here
that says what is wrong, never a failure there.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from crane_mp.frontend.serving.json_bounds import bounded_schema
from crane_mp.frontend.web.errors import ApiError
from crane_mp.model_tokenizer import grammar_tokenizer
from crane_mp.priority import lower_this_thread
from crane_mp.protocol import SamplingParams, WorkerReady

# JSON as models write it: one space after ':' and ',' and nowhere else. Free whitespace lets a small
# model pad forever (a well-known failure of grammar-constrained JSON); clients can ask for it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Validated grammars kept, by count and by characters (constraint plus grammar text): the schemas a
# service repeats are a few KB, and a stream of large one-off schemas must not grow the process.
_CACHED = 512
_CACHED_CHARS = 1 << 20
# A constraint's text: far above any schema a client writes by hand (a 200 KB one validates in ~0.2 s).
_MAX_SOURCE_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class Constraint:
    """kind: json_schema | json_object | regex | choice | grammar (EBNF, GBNF or Lark) | lark (tool
    calling's own grammars); `param` is the request field it came from, named in errors."""

    kind: str
    source: str  # the schema as canonical JSON, the regex, the choices as a JSON list, or the grammar
    param: str
    whitespace_pattern: str | None = None

    @staticmethod
    def json_schema(schema: Any, param: str, whitespace_pattern: str | None = None) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ApiError(400, f"{param} is not valid JSON: {err}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, f"{param} must be a JSON schema object", param)
        return Constraint("json_schema", json.dumps(schema, sort_keys=True), param, whitespace_pattern)

    @staticmethod
    def choice(choices: list[str], param: str) -> Constraint:
        if not choices:
            raise ApiError(400, f"{param} must list at least one choice", param)
        return Constraint("choice", json.dumps(choices), param)


def constraints_in(fields: dict[str, tuple[str, Any]], whitespace_pattern: str | None = None) -> list[Constraint]:
    """The constraints a group of request fields sets: kind -> (field name, value); unset values
    (None, False) are skipped. Kinds as Constraint's, plus json_object (a bool)."""
    found = []
    for kind, (param, value) in fields.items():
        if value is None or value is False:
            continue
        if kind == "json_schema":
            found.append(Constraint.json_schema(value, param, whitespace_pattern))
        elif kind == "json_object":
            found.append(Constraint("json_object", "", param, whitespace_pattern))
        elif kind == "choice":
            found.append(Constraint.choice(value, param))
        else:
            found.append(Constraint(kind, value, param))
    return found


def one_constraint(found: list[Constraint]) -> Constraint | None:
    """The request's constraint, if any; a 400 naming them when it sets several."""
    if len(found) > 1:
        raise ApiError(400, "give one output constraint, not several: " + ", ".join(c.param for c in found),
                       found[1].param)
    return found[0] if found else None


class GrammarCompiler:
    """Constraint -> validated llguidance grammar text, cached; the vocabulary view is built on first use."""

    def __init__(self, tokenizer_service, timeout: float) -> None:
        self.service = tokenizer_service
        self.timeout = timeout
        # One thread: a flood of new schemas queues here (and times out), never in the tokenizer's pool;
        # at the lowest priority, so that it takes no core from the worker's step (priority.py).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar", initializer=lower_this_thread)
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()
        self._cache: OrderedDict[Constraint, str] = OrderedDict()
        self._cached_chars = 0

    async def constrain(self, params: SamplingParams, constraint: Constraint | None,
                        engine: WorkerReady) -> SamplingParams:
        """`params` with the constraint's grammar (unchanged without one)."""
        if constraint is None:
            return params
        grammar = await self.compile(constraint, engine.vocab_size, engine.eos_token_ids)
        return msgspec.structs.replace(params, grammar=grammar)

    async def compile(self, constraint: Constraint, vocab_size: int, eos_token_ids: list[int]) -> str:
        cached = self._cache.get(constraint)
        if cached is not None:
            self._cache.move_to_end(constraint)
            return cached
        if len(constraint.source) > _MAX_SOURCE_CHARS:
            raise ApiError(400, f"{constraint.param} is {len(constraint.source)} characters long; at most "
                                f"{_MAX_SOURCE_CHARS}", constraint.param)
        await self.load_vocabulary(vocab_size, eos_token_ids)
        loop = asyncio.get_running_loop()
        try:
            grammar = await asyncio.wait_for(loop.run_in_executor(self._pool, self._validated, constraint),
                                             self.timeout)
        except TimeoutError:
            raise ApiError(400, f"{constraint.param} did not compile within {self.timeout:g} s (--grammar-timeout)",
                           constraint.param) from None
        self._remember(constraint, grammar)
        return grammar

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def load_vocabulary(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        """Build llguidance's view of the vocabulary (a second for 150k tokens); the frontend starts it
        as soon as the engine is ready, so that the first constrained request does not wait for it."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = await asyncio.get_running_loop().run_in_executor(
                    self.service.pool, grammar_tokenizer, self.service.tokenizer, vocab_size, eos_token_ids
                )

    def _remember(self, constraint: Constraint, grammar: str) -> None:
        size = len(constraint.source) + len(grammar)
        if size > _CACHED_CHARS or constraint in self._cache:
            return
        self._cache[constraint] = grammar
        self._cached_chars += size
        while len(self._cache) > _CACHED or self._cached_chars > _CACHED_CHARS:
            evicted, text = self._cache.popitem(last=False)
            self._cached_chars -= len(evicted.source) + len(text)

    def _validated(self, constraint: Constraint) -> str:
        from llguidance import LLMatcher

        try:
            grammar = to_grammar(constraint)
        except ValueError as err:
            raise ApiError(400, f"invalid {constraint.param}: {err}", constraint.param) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ApiError(400, f"invalid {constraint.param}: {messages[0]}", constraint.param)
        return grammar


def to_grammar(constraint: Constraint) -> str:
    """The llguidance grammar text of a constraint; ValueError when it cannot be read at all."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind, source = constraint.kind, constraint.source
    if kind in ("json_schema", "json_object"):
        options = dict(_JSON_OPTIONS)
        if constraint.whitespace_pattern is not None:
            options.update(whitespace_flexible=True, whitespace_pattern=constraint.whitespace_pattern)
        schema = json.loads(source) if kind == "json_schema" else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(json.dumps(bounded_schema(schema)), defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(source)))
    if kind == "grammar":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(source))
        except ValueError:
            raise
        except Exception as err:  # the GBNF converter raises whatever its parser hit
            raise ValueError(f"cannot read the grammar as GBNF/EBNF or Lark: {err}") from None
    if kind == "lark":  # tool calling's own grammars (tools/forcing.py), already Lark
        return LLMatcher.grammar_from_lark(source)
    raise ValueError(f"unknown constraint kind {kind!r}")
