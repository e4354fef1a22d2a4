"""Structured output in the sampler: constrained rows follow their grammar to the end whatever the
logits say, unconstrained rows of the same batch are untouched, matchers survive as the worker keeps
them, and a finished grammar leaves only EOS even under min_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from crane_mp.frontend.serving.structured import Constraint, to_grammar
from crane_mp.frontend.tools.forcing import forced_call_constraint
from crane_mp.frontend.tools.formats import FORMATS
from crane_mp.frontend.tools.parser import parse_tool_calls
from crane_mp.model_tokenizer import grammar_tokenizer, load_tokenizer
from crane_mp.models.gguf_file import resolve_model_source
from crane_mp.protocol import SamplingParams, ThinkingBudget
from crane_mp.testing.make_model import make_model
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.sampling.grammar import GrammarEngine
from crane_mp.worker.sampling.sampler import Sampler

CPU_PLATFORM = platform_for("cpu")
EOS = 507  # the tiny model's <|im_end|>; <|endoftext|> (505) ends generation too
EOS_IDS = (507, 505)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(str(model_dir))


@pytest.fixture()
def grammars(model_dir):
    return GrammarEngine(resolve_model_source(model_dir), 512, list(EOS_IDS), CPU_PLATFORM)


def run(sampler: Sampler, states, steps: int, seed: int = 0) -> list[list[int]]:
    """Sample until every row drew EOS (or `steps` ran out) from random logits."""
    outputs: list[list[int]] = [[] for _ in states]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        live = [row for row, out in enumerate(outputs) if not out or out[-1] not in EOS_IDS]
        if not live:
            break
        logits = torch.randn(len(live), 512, generator=generator) * 4
        tokens, _ = sampler.sample(logits, [states[row] for row in live])
        for row, token in zip(live, tokens):
            outputs[row].append(token)
        sampler.record([states[row] for row in live], tokens)
    return outputs


def test_constrained_rows_follow_their_grammar_beside_a_free_row(grammars, tokenizer):
    params = [SamplingParams(seed=1, grammar=LLMatcher.grammar_from_json_schema(SCHEMA)),
              SamplingParams(seed=2, grammar=LLMatcher.grammar_from_regex(r"(yes|no)-[0-9]{2,3}")),
              SamplingParams(seed=3)]
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    states = [sampler.new_state(p, [1, 2], EOS_IDS) for p in params]
    outputs = run(sampler, states, 200)

    json_out, regex_out, free = outputs
    assert json_out[-1] in EOS_IDS and regex_out[-1] in EOS_IDS
    jsonschema.validate(json.loads(tokenizer.decode(json_out[:-1])), SCHEMA)
    assert re.fullmatch(r"(yes|no)-[0-9]{2,3}", tokenizer.decode(regex_out[:-1]))

    # The free row draws exactly what it draws alone: its noise is a function of its seed and position.
    sampler = Sampler(512, CPU_PLATFORM)
    alone = sampler.new_state(SamplingParams(seed=3), [1, 2], EOS_IDS)
    reference = []
    generator = torch.Generator().manual_seed(0)
    for step in range(len(free)):
        live = 3 - sum(1 for out in (json_out, regex_out) if len(out) <= step)
        logits = torch.randn(live, 512, generator=generator) * 4
        reference += sampler.sample(logits[live - 1 :], [alone])[0]
        sampler.record([alone], reference[-1:])
    assert free == reference


def test_choice_grammar_is_cached_and_every_request_gets_its_own_matcher(grammars, tokenizer):
    grammar = LLMatcher.grammar_from_lark('start: "red" | "green" | "blue"')
    first = grammars.new_matcher(None, grammar)
    second = grammars.new_matcher(None, grammar)
    assert first is not second and len(grammars._pristine) == 1
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    states = [sampler.new_state(SamplingParams(seed=s, grammar=grammar), [1], EOS_IDS) for s in range(6)]
    outputs = run(sampler, states, 20, seed=4)
    assert {tokenizer.decode(out[:-1]) for out in outputs} <= {"red", "green", "blue"}


def test_a_prepared_matcher_is_held_for_its_request_whatever_the_cache_keeps(grammars, monkeypatch):
    import crane_mp.worker.sampling.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "_CACHED_GRAMMAR_BYTES", 200)
    small = LLMatcher.grammar_from_regex("ab")
    large = LLMatcher.grammar_from_json_schema(SCHEMA)
    assert len(small) <= 200 < len(large)
    grammars.prepare(6, small)
    assert not grammars._pristine  # built once: not kept past its request
    grammars.prepare(7, large)
    grammars.prepare(8, large)
    grammars.prepare(9, small)
    assert list(grammars._pristine) == [small]  # repeated and within the cache's bound
    assert set(grammars._prepared) == {6, 7, 8, 9}

    built = []
    monkeypatch.setattr(grammar_module.GrammarEngine, "_pristine_matcher", lambda self, g: built.append(g))
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    state = sampler.new_state(SamplingParams(seed=1, grammar=large), [1], EOS_IDS, req_id=7)
    assert built == [] and state.matcher is not None  # a copy of the prepared one: nothing built in the step
    for rid in (6, 8, 9):  # ended before their first step
        grammars.forget(rid)
    assert not grammars._prepared


def test_the_matcher_cache_keeps_to_its_byte_budget(grammars, monkeypatch):
    import crane_mp.worker.sampling.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "_CACHED_GRAMMAR_BYTES", 250)  # two of these ~106-byte grammars
    texts = [LLMatcher.grammar_from_regex(f"{word}[0-9]+") for word in ("alpha", "beta", "gamma", "delta")]
    for text in texts * 40:
        grammars.new_matcher(None, text)
    assert grammars._cached_bytes == sum(map(len, grammars._pristine)) <= 250
    assert list(grammars._pristine) == texts[2:]  # the most recent


def test_a_complete_grammar_overrides_min_tokens(grammars):
    params = SamplingParams(temperature=0.0, min_tokens=50, grammar=LLMatcher.grammar_from_regex("ok"))
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    out = run(sampler, [sampler.new_state(params, [1], EOS_IDS)], 10)[0]
    assert out[-1] in EOS_IDS and len(out) <= 3  # "ok" then EOS, though min_tokens asked for 50


def test_greedy_takes_the_best_allowed_token(grammars):
    grammar = LLMatcher.grammar_from_regex("[0-9]+")
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    state = sampler.new_state(SamplingParams(temperature=0.0, grammar=grammar), [1], EOS_IDS)
    logits = torch.zeros(1, 512)
    digit_ids = list(range(15, 25))  # byte-level tokens of "0".."9" in the tiny vocabulary
    logits[0, 300] = 100.0  # a token the grammar forbids
    logits[0, digit_ids[7]] = 5.0
    tokens, _ = sampler.sample(logits, [state])
    assert tokens == [digit_ids[7]]


def test_a_request_without_an_engine_for_grammars_is_refused():
    with pytest.raises(ValueError, match="structured output"):
        Sampler(512, CPU_PLATFORM).new_state(SamplingParams(grammar=LLMatcher.grammar_from_regex("a")), [1], EOS_IDS)


def test_a_grammar_waits_until_the_answer_stops_thinking(grammars, tokenizer):
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    grammar = LLMatcher.grammar_from_regex("[0-9]+")
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    params = [SamplingParams(seed=2, grammar=grammar, thinking=ThinkingBudget(3, think, end, opened=True)),
              SamplingParams(seed=3, grammar=grammar)]
    states = [sampler.new_state(p, [1], EOS_IDS) for p in params]
    outputs: list[list[int]] = [[] for _ in states]
    generator = torch.Generator().manual_seed(5)
    for _ in range(40):
        live = [row for row, out in enumerate(outputs) if not out or out[-1] not in EOS_IDS]
        if not live:
            break
        logits = torch.randn(2, 512, generator=generator) * 4
        logits[:, end] = -50.0  # only the budget closes the thinking
        tokens, _ = sampler.sample(logits[live], [states[row] for row in live])
        sampler.record([states[row] for row in live], tokens)
        for row, token in zip(live, tokens):
            outputs[row].append(token)
    thought, direct = outputs
    assert thought[3] == end  # the prompt opened the block: 3 free tokens, then the forced </think>
    assert not re.fullmatch(r"[0-9]*", tokenizer.decode(thought[:3]))  # the grammar waited
    assert re.fullmatch(r"[0-9]+", tokenizer.decode(thought[4:-1])) and thought[-1] in EOS_IDS
    assert re.fullmatch(r"[0-9]+", tokenizer.decode(direct[:-1]))


def test_a_tokenizer_larger_than_the_logits_widens_the_grammar_vocabulary(model_dir, tokenizer):
    """transformers' GGUF conversion may add tokens past the file's table (151,938 for a 151,936-row
    model, seen with transformers 5.17): llguidance refused such a vocabulary. Masks then span the
    tokenizer and are cut to the logits."""
    size = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    narrow = size - 2
    assert grammar_tokenizer(tokenizer, narrow, [505]).vocab_size == size
    engine = GrammarEngine(resolve_model_source(model_dir), narrow, [505], CPU_PLATFORM)
    matcher = engine.new_matcher(None, LLMatcher.grammar_from_regex("[0-9]{3}"))
    logits = torch.zeros(1, narrow)
    engine.mask(logits, [0], [matcher])
    allowed = {tokenizer.decode([i]) for i in (logits[0] > -1).nonzero().flatten().tolist()}
    assert allowed and all(text.isdigit() for text in allowed)


NOTE = {"type": "object", "properties": {"note": {"type": "string"}, "items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}, "required": ["note", "items"]}
NOTE_GRAMMAR = to_grammar(Constraint.json_schema(NOTE, "response_format"))  # as the frontend sends it


def quote_ids(tokenizer) -> list[int]:
    return [i for i in range(512) if '"' in tokenizer.decode([i])]


def run_to_budget(sampler: Sampler, state, tokenizer, seed: int, banned: list[int],
                  end: int | None = None) -> list[int]:
    """Sample as the scheduler stops: at EOS or max_tokens; the `banned` tokens never win freely (a
    model that never closes its strings), nor does `end`."""
    out: list[int] = []
    generator = torch.Generator().manual_seed(seed)
    while len(out) < state.params.max_tokens and (not out or out[-1] not in EOS_IDS):
        logits = torch.randn(1, 512, generator=generator) * 4
        logits[0, banned] = -60.0
        if end is not None:
            logits[0, end] = -60.0
        tokens, _ = sampler.sample(logits, [state])
        sampler.record([state], tokens)
        out += tokens
    return out


def test_closing_path_ends_the_grammar_and_leaves_the_matcher_as_it_was(grammars, tokenizer):
    matcher = grammars.new_matcher(None, NOTE_GRAMMAR)
    assert matcher.consume_tokens(tokenizer.encode('{"items": [], "note": "abc def'))
    before = matcher.compute_bitmask()
    path = grammars.closing_path(matcher, 64)
    assert matcher.compute_bitmask() == before and not matcher.is_accepting()
    closed = '{"items": [], "note": "abc def' + tokenizer.decode(path)
    jsonschema.validate(json.loads(closed), NOTE)
    assert grammars.closing_path(matcher, len(path) - 1) is None  # not within a shorter budget
    assert matcher.compute_bitmask() == before


@pytest.mark.parametrize("max_tokens", [22, 23, 40, 70, 120])  # 22: {"items": [], "note": ""}, the shortest
def test_a_grammar_that_would_outrun_max_tokens_is_closed_in_time(grammars, tokenizer, max_tokens):
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    grammar = NOTE_GRAMMAR
    for seed in range(4):
        state = sampler.new_state(SamplingParams(seed=seed, max_tokens=max_tokens, grammar=grammar), [1], EOS_IDS)
        out = run_to_budget(sampler, state, tokenizer, seed, quote_ids(tokenizer))
        text = tokenizer.decode(out[:-1] if out[-1] in EOS_IDS else out)
        jsonschema.validate(json.loads(text), NOTE)
        assert len(out) <= max_tokens and state.cut_short


def test_a_budget_too_small_for_the_grammar_is_left_to_run_out(grammars, tokenizer):
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    state = sampler.new_state(SamplingParams(seed=1, max_tokens=21, grammar=NOTE_GRAMMAR), [1], EOS_IDS)
    out = run_to_budget(sampler, state, tokenizer, 1, quote_ids(tokenizer))
    assert len(out) == 21 and not state.cut_short and not state.closing


def test_thinking_ends_in_time_for_the_grammar_to_end_within_max_tokens(grammars, tokenizer):
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    params = SamplingParams(seed=4, max_tokens=60, grammar=NOTE_GRAMMAR,
                            thinking=ThinkingBudget(1000, think, end, opened=True))
    state = sampler.new_state(params, [1], EOS_IDS)
    out = run_to_budget(sampler, state, tokenizer, 4, quote_ids(tokenizer), end=end)
    answer = out[out.index(end) + 1:]
    jsonschema.validate(json.loads(tokenizer.decode(answer[:-1] if answer[-1] in EOS_IDS else answer)), NOTE)
    assert out.index(end) > 20 and len(out) <= 60


def test_a_walk_lost_in_free_text_stops_early(grammars, tokenizer):
    """Free text that none of the closers ends (a lazy Lark string, as an XML tool call's parameter)
    makes the walk take one token over and over: it stops after a few dozen, not at the budget."""
    matcher = grammars.new_matcher(None, LLMatcher.grammar_from_lark('start: "<p>" TEXT "</p>"\nTEXT: /(.|\\n)*/'))
    assert matcher.consume_tokens(tokenizer.encode("<p>some text"))
    calls = []
    step = grammars._closing_step
    grammars._closing_step = lambda m: calls.append(1) or step(m)
    assert grammars.closing_path(matcher, 10_000) is None and len(calls) <= 80


SHORT_CITY = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}}]


def forced_calls_grammar(tokenizer) -> str:
    """tool_choice "required" with parallel calls, as the frontend sends it for the tiny Qwen3."""
    added = tokenizer.get_added_vocab()
    markers = {marker: added[marker] for marker in ("<tool_call>", "</tool_call>")}
    return to_grammar(forced_call_constraint(FORMATS["hermes"], SHORT_CITY, None, True, markers))


def test_the_ways_on_from_an_end_are_measured_and_the_matcher_left_as_it_was(grammars, tokenizer):
    matcher = grammars.new_matcher(None, forced_calls_grammar(tokenizer))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    assert matcher.consume_tokens(tokenizer.encode(call)) and matcher.is_accepting()
    before = matcher.compute_bitmask()
    shortest = grammars.shortest_continuation(matcher, 1024)
    minimal = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": ""}}\n</tool_call>'
    assert shortest is not None and shortest <= len(tokenizer.encode(minimal))  # a second call, at its shortest
    assert matcher.compute_bitmask() == before


@pytest.mark.parametrize("max_tokens", [60, 75, 90, 110])
def test_forced_calls_end_after_the_last_call_max_tokens_lets_finish(grammars, tokenizer, max_tokens):
    """A model that would call on and on (EOS never wins freely): once another call could not end
    within max_tokens, the grammar ends after the current one, and every call the answer holds is whole
    (issue 47: the cut second call left the answer as raw text)."""
    sampler = Sampler(512, CPU_PLATFORM, grammars)
    grammar = forced_calls_grammar(tokenizer)
    for seed in range(3):
        state = sampler.new_state(SamplingParams(seed=seed, max_tokens=max_tokens, grammar=grammar), [1], EOS_IDS)
        out = run_to_budget(sampler, state, tokenizer, seed, list(EOS_IDS))
        assert out[-1] in EOS_IDS and len(out) <= max_tokens and state.cut_short
        content, calls = parse_tool_calls(FORMATS["hermes"], tokenizer.decode(out[:-1]))
        assert calls and content is None, tokenizer.decode(out)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SHORT_CITY[0]["function"]["parameters"])
