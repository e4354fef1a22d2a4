"""Constrained field types shared by every request schema: one declaration gives both the check made
while the body is decoded (a 400 naming the field) and the OpenAPI schema.

Every integer is bounded so it fits the 64-bit msgpack encoding between processes. Limits that
depend on the served model (vocabulary size, context window) carry a MODEL_LIMIT mark: handlers
check them against the model, and `fill_model_limits` writes them into the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MODEL_LIMIT = "x-crane-limit"
_VOCAB = {MODEL_LIMIT: "vocab"}  # a token id: below the vocabulary size; "context": a prompt's ids;
# "hidden": at most the model's hidden size (embedding dimensions)

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
PositiveCount = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1, extra_json_schema=_VOCAB)]
TokenIdKey = Annotated[str, Meta(pattern=r"^(0|[1-9][0-9]{0,9})$", extra_json_schema=_VOCAB)]
NonEmptyText = Annotated[str, Meta(min_length=1)]
Dimensions = Annotated[int, Meta(ge=1, le=INT64_MAX, extra_json_schema={MODEL_LIMIT: "hidden"})]

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX, description="-1 or 0: disabled")]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
LogitBias = dict[TokenIdKey, Annotated[float, Meta(ge=-100.0, le=100.0)]]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
StopString = Annotated[str, Meta(max_length=256)]
StopStrings = StopString | Annotated[list[StopString], Meta(max_length=16)]
# An SGLang option crane-mp does not implement, which SGLang clients and sglang-router send at its
# default: accepted as false, a 400 as true.
OffOnly = Annotated[Literal[False], Meta(description="not supported: false (the default) only")]


def ids_below_pattern(limit: int) -> str:
    """A regex for the decimal integers 0 .. limit - 1, without signs or leading zeros."""
    top = str(limit - 1)
    alternatives = ["[0-9]"] if len(top) > 1 else [f"[0-{top}]"]
    alternatives += [f"[1-9][0-9]{{{length - 1}}}" for length in range(2, len(top))]
    if len(top) > 1:
        for i, digit in enumerate(top):
            low = 1 if i == 0 else 0
            if int(digit) > low:
                alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
        alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def fill_model_limits(schema: object, vocab_size: int, max_model_len: int, hidden_size: int = 0) -> None:
    """Write the served model's limits into a JSON schema (in place) where MODEL_LIMIT marks them."""
    if isinstance(schema, list):
        for item in schema:
            fill_model_limits(item, vocab_size, max_model_len, hidden_size)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get(MODEL_LIMIT)
    if kind == "vocab" and "pattern" in schema:
        schema["pattern"] = ids_below_pattern(vocab_size)
    elif kind == "vocab":
        schema["maximum"] = vocab_size - 1
    elif kind == "context":
        schema["maxItems"] = max_model_len - 1
    elif kind == "hidden" and hidden_size:
        schema["maximum"] = hidden_size
    for value in schema.values():
        fill_model_limits(value, vocab_size, max_model_len, hidden_size)


def exactly_one_of(*names: str) -> dict:
    """A JSON schema clause: exactly one of these properties is present and not null."""

    def only(name: str) -> dict:
        return {"required": [name], "properties": {
            other: {"not": {"type": "null"}} if other == name else {"type": "null"} for other in names}}

    return {"oneOf": [only(name) for name in names]}
