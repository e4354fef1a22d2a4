"""SGLang's native request bodies as msgspec Structs (/generate, /abort_request): decoding validates
types, unknown fields and ranges, as openai/schemas.py does for the OpenAI routes."""

from __future__ import annotations

from typing import Annotated

import msgspec

from crane_mp.frontend.openai.schemas import MAX_BATCH, PROMPT_IDS_BATCH_SCHEMA, PROMPT_IDS_SCHEMA, check_token_ids
from crane_mp.frontend.serving.structured import Constraint, constraints_in, one_constraint
from crane_mp.frontend.web.fields import (
    INT64_MAX,
    Count,
    Int64,
    MinP,
    NonEmptyText,
    NumChoices,
    OffOnly,
    Penalty,
    RepetitionPenalty,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
)
from crane_mp.protocol import SamplingParams


class SGLangSamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_new_tokens: Count = 128  # clamped to the context window; 0 scores the input only
    min_new_tokens: Count = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None  # SGLang's own name for seed
    n: NumChoices = 1
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None

    def constraint(self) -> Constraint | None:
        """The one output constraint set, if any; a 400 when several are."""
        return one_constraint(constraints_in({
            "json_schema": ("sampling_params.json_schema", self.json_schema),
            "regex": ("sampling_params.regex", self.regex), "grammar": ("sampling_params.ebnf", self.ebnf)}))

    def to_sampling(self, vocab_size: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (ranges were checked while decoding; here the served model's
        vocabulary). max_tokens is set per prompt by pipeline.serve."""
        stop_ids = list(self.stop_token_ids or [])
        check_token_ids(stop_ids, vocab_size, "stop_token_ids")
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed if self.seed is not None else self.sampling_seed,
            min_tokens=self.min_new_tokens, stop_token_ids=stop_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )


class SGLangGenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of text or input_ids (openapi.py states it with fields.exactly_one_of)."""

    text: NonEmptyText | Annotated[list[NonEmptyText], msgspec.Meta(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: list[int | list[int]] | None = None  # INPUT_IDS_SCHEMA: one prompt's ids, or a batch of them
    # A single prompt's images, in the order of its image tokens: http(s) or data: URLs, or base64 bytes.
    image_data: str | Annotated[list[str], msgspec.Meta(max_length=MAX_BATCH)] | None = None
    sampling_params: SGLangSamplingParams | None = None
    # One name for the whole request, or one per prompt (prompts past the list get generated names).
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] = -1
    top_logprobs_num: TopLogprobs = 0
    return_text_in_logprobs: bool = False
    model: str | None = None
    lora_path: str | list[str | None] | None = None  # a --lora-modules name, for all prompts or per prompt
    # The thinking apart from the answer, as `reasoning_text` (with --reasoning-parser): text is the answer.
    separate_reasoning: bool = False
    # SGLang's further options, which sglang-router writes into every request it forwards: the logging
    # ones accepted and ignored, the others at their default only.
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: OffOnly = False
    background: OffOnly = False
    return_bytes: OffOnly = False
    return_entropy: OffOnly = False


INPUT_IDS_SCHEMA = {"anyOf": [PROMPT_IDS_SCHEMA, PROMPT_IDS_BATCH_SCHEMA]}


class SeparateReasoningRequest(msgspec.Struct, kw_only=True):
    """SGLang's /separate_reasoning: `reasoning_parser` deepseek-r1 (and qwen3-thinking) reads a text
    that starts thinking without a `<think>`; qwen3 one that thinks only inside `<think>`; none given:
    qwen3's rule."""

    text: str
    reasoning_parser: str | None = None


class AbortBody(msgspec.Struct, kw_only=True):
    rid: str = ""
