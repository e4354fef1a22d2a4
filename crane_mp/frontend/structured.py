"""Structured output in the frontend: a request's constraint (JSON schema, JSON object, regex, choice,
EBNF/GBNF or Lark grammar) -> a grammar in llguidance's form, validated against the served vocabulary.

Validation runs on a thread of its own (a large schema takes a fraction of a second, a pathological
one longer; llguidance releases the GIL, so the event loop goes on) within --grammar-timeout, and its
result is cached by constraint, so a schema sent with every request is checked once. A constraint's
text is at most _MAX_SOURCE_CHARS. The worker builds the same matcher from the text, beside its step
loop, before the request is scheduled (worker/background.py); an invalid constraint is a 400 here
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

from crane_mp.frontend.errors import ApiError
from crane_mp.model_tokenizer import grammar_tokenizer
from crane_mp.protocol import SamplingParams, WorkerReady

# JSON as models write it: one space after ':' and ',' and nowhere else. Free whitespace lets a small
# model pad forever (a well-known failure of grammar-constrained JSON); clients can ask for it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED = 512
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
        # One thread: a flood of new schemas queues here (and times out), never in the tokenizer's pool.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()
        self._cache: OrderedDict[Constraint, str] = OrderedDict()

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
        loop = asyncio.get_running_loop()
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = await loop.run_in_executor(
                    self.service.pool, grammar_tokenizer, self.service.tokenizer, vocab_size, eos_token_ids
                )
        try:
            grammar = await asyncio.wait_for(loop.run_in_executor(self._pool, self._validated, constraint),
                                             self.timeout)
        except TimeoutError:
            raise ApiError(400, f"{constraint.param} did not compile within {self.timeout:g} s (--grammar-timeout)",
                           constraint.param) from None
        self._cache[constraint] = grammar
        if len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return grammar

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
        schema = source if kind == "json_schema" else '{"type": "object"}'
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
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
