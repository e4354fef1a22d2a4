"""Bounded JSON schemas (frontend/serving/json_bounds.py): numbers a schema leaves open end within 16 integer
and 10 fraction digits, free values are any JSON with numbers so bounded, and what a schema states is
kept; checked by feeding documents to llguidance matchers of the bounded grammars."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from llguidance import LLMatcher

from crane_mp.frontend.serving.json_bounds import bounded_schema
from crane_mp.frontend.serving.structured import Constraint, to_grammar
from crane_mp.model_tokenizer import grammar_tokenizer, load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["x", "n"],
          "properties": {"x": {"type": "number"}, "n": {"type": "integer", "minimum": 0},
                         "half": {"type": "number", "multipleOf": 0.5, "maximum": 3},
                         "tags": {"type": "array"}, "extra": {}}}


@pytest.fixture(scope="module")
def admits(model_dir):
    hf = load_tokenizer(str(model_dir))
    tokenizer = grammar_tokenizer(hf, len(hf), [hf.eos_token_id])

    def check(kind: str, source: str, document: str) -> bool:
        matcher = LLMatcher(tokenizer, to_grammar(Constraint(kind, source, "response_format")), log_level=0)
        ids = hf.encode(document, add_special_tokens=False)
        return all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()

    return check


@pytest.mark.parametrize("document, admitted", [
    ('{"x": 0.5, "n": 3}', True),
    ('{"x": -1234567890123456.0123456789, "n": 0}', True),
    ('{"x": 0.12345678901, "n": 3}', False),  # 11 fraction digits
    ('{"x": 12345678901234567, "n": 3}', False),  # 17 integer digits
    ('{"x": 1, "n": -1}', False),  # the schema's own minimum stands
    ('{"x": 1, "n": 1, "half": 2.5}', True),
    ('{"x": 1, "n": 1, "half": 2.25}', False),  # ... and its own multipleOf
    ('{"x": 1, "n": 1, "tags": [1.5, "a", {"b": null}], "extra": [true]}', True),
    ('{"x": 1, "n": 1, "tags": [0.00000000001]}', False),  # a free value's number is bounded too
])
def test_open_numbers_end_and_stated_bounds_stand(admits, document, admitted):
    assert admits("json_schema", json.dumps(SCHEMA), document) is admitted
    if admitted:
        jsonschema.validate(json.loads(document), SCHEMA)


def test_json_object_mode_bounds_every_number(admits):
    assert admits("json_object", "", '{"a": [1, 2.5], "b": {"c": -3}}')
    assert not admits("json_object", "", '{"a": 0.80000000000000000}')


def test_the_clients_schema_is_not_changed():
    original = copy.deepcopy(SCHEMA)
    bounded = bounded_schema(SCHEMA)
    assert SCHEMA == original and bounded != original
    assert bounded["properties"]["half"] == {"type": "number", "multipleOf": 0.5, "maximum": 3,
                                             "minimum": -(10**16 - 1)}
