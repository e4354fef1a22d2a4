"""The schema helpers behind /openapi.json: exact token-id key patterns and the served model's limits."""

from __future__ import annotations

import re

import pytest

from crane_mp.frontend.web.fields import MODEL_LIMIT, fill_model_limits, ids_below_pattern


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 512, 1000, 1001, 8192, 151936])
def test_token_id_pattern_matches_exactly_the_ids_below_the_limit(limit):
    pattern = re.compile(ids_below_pattern(limit))
    accepted = [i for i in range(limit + 300) if pattern.fullmatch(str(i))]
    assert accepted == list(range(limit))
    assert not any(pattern.fullmatch(s) for s in ("-1", "01", "", " 1", "1.0", "²"))


def test_model_limits_are_written_where_marked():
    schema = {"a": {MODEL_LIMIT: "vocab", "type": "integer", "maximum": 2**31 - 1},
              "b": [{MODEL_LIMIT: "vocab", "pattern": "x"}], "c": {MODEL_LIMIT: "context", "type": "array"}}
    fill_model_limits(schema, vocab_size=512, max_model_len=64)
    assert schema["a"]["maximum"] == 511 and schema["c"]["maxItems"] == 63
    assert re.fullmatch(schema["b"][0]["pattern"], "511") and not re.fullmatch(schema["b"][0]["pattern"], "512")
