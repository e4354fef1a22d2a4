"""OpenAI request bodies as msgspec Structs: decoding validates types, unknown fields and ranges.

Anything a client gets wrong becomes a 400 with the offending field named, never a 500. The Structs
(with fields.py's constrained types) are also the OpenAPI schema, so a body the document allows is a
body the server accepts: cross-field rules are lenient where a schema cannot express them
(min_tokens above max_tokens is clamped, top_logprobs without logprobs is ignored).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from crane_mp.frontend.serving.structured import Constraint, constraints_in, one_constraint
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.fields import (
    MODEL_LIMIT,
    Count,
    Dimensions,
    Int64,
    LogitBias,
    MinP,
    NumChoices,
    OffOnly,
    Penalty,
    PositiveCount,
    RepetitionPenalty,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
)
from crane_mp.protocol import SamplingParams

# JSON nesting a free-form value (chat_template_kwargs) may have; the template engine recurses into it.
MAX_NESTING = 16
# Prompts in one /v1/completions or /generate batch (each runs n times).
MAX_BATCH = 64


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # none: any JSON object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: one constraint, and how JSON may be spaced."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False  # JSON is compact unless whitespace_pattern allows more


# Request fields whose content the schema cannot judge (a regex, a grammar, a JSON schema to compile,
# tools and the choice among them): checked when the request is served, each error a 400 naming it.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_whitespace_pattern", "tools", "tool_choice")


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    seed: Int64 | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: NumChoices = 1
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids of prompt and completion in the response
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: there is one backend
    # SGLang's, which sglang-router writes into every request it forwards.
    no_stop_trim: OffOnly = False
    return_hidden_states: OffOnly = False

    def constraint(self) -> Constraint | None:
        """The one output constraint the request sets, if any; a 400 when it sets several."""
        found: list[Constraint] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(Constraint("json_object", "", "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ApiError(400, "response_format of type json_schema needs a json_schema", "response_format")
            schema = fmt.json_schema.schema if fmt.json_schema.schema is not None else {"type": "object"}
            found.append(Constraint.json_schema(schema, "response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            found += constraints_in({
                "json_schema": ("structured_outputs.json", so.json),
                "json_object": ("structured_outputs.json_object", so.json_object),
                "regex": ("structured_outputs.regex", so.regex),
                "choice": ("structured_outputs.choice", so.choice),
                "grammar": ("structured_outputs.grammar", so.grammar),
            }, so.whitespace_pattern)
        found += constraints_in({
            "json_schema": ("guided_json", self.guided_json),
            "regex": ("guided_regex", self.guided_regex),
            "choice": ("guided_choice", self.guided_choice),
            "grammar": ("guided_grammar", self.guided_grammar),
        }, self.guided_whitespace_pattern)
        return one_constraint(found)


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=False):
    text: str


class ImageUrl(msgspec.Struct, forbid_unknown_fields=False):
    url: str  # a data: URL, or http(s) from a host --allowed-media-domains names
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes every image


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=False):
    image_url: ImageUrl


class VideoUrl(msgspec.Struct, forbid_unknown_fields=False):
    url: str  # a data:video/...;base64 URL, or http(s) from a host --allowed-media-domains names


class VideoPart(msgspec.Struct, tag_field="type", tag="video_url", forbid_unknown_fields=False):
    """vLLM's spelling of a video in chat (Qwen3-VL's and Qwen3.5's)."""

    video_url: VideoUrl


class CalledFunction(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON text; a template wants the object


class AssistantToolCall(msgspec.Struct, forbid_unknown_fields=False):
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart | ImagePart | VideoPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    # vLLM's per-request image processor settings: min_pixels / max_pixels (crane_mp/media_settings.py).
    mm_processor_kwargs: dict[str, Any] | None = None
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: passed to the chat template (gpt-oss's reads it); "none" also sets enable_thinking false.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    separate_reasoning: bool = True  # SGLang's: false leaves a reasoning model's thinking in content
    stream_reasoning: bool = True  # SGLang's; accepted and ignored: thinking always streams as it comes
    # Tokens a reasoning model may think before `</think>` is forced (llama.cpp's --reasoning-budget);
    # both spellings clients use.
    thinking_budget: Count | None = None
    max_thinking_tokens: Count | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort, where the request sets it (its own kwargs win)."""
        return effort_kwargs(self.reasoning_effort, self.chat_template_kwargs)


def effort_kwargs(effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat template's kwargs with a request's reasoning effort: `reasoning_effort` (gpt-oss's templates),
    and for "none" enable_thinking false (Qwen3's); `kwargs` set by the request win."""
    if effort is None:
        return kwargs
    implied = {"reasoning_effort": effort} | ({"enable_thinking": False} if effort == "none" else {})
    return implied | (kwargs or {})


class CompletionRequest(_SamplingFields, kw_only=True):
    # One of PROMPT_SCHEMA's four forms; msgspec unions take one array type, so prompt_inputs checks.
    prompt: str | list[str | int | list[int]]
    max_tokens: Count | None = None  # 16, as OpenAI's
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: Annotated[str, msgspec.Meta(max_length=0, description="not supported: empty or null")] | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1, description="only 1 is supported")] | None = None


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # PROMPT_SCHEMA's forms, up to MAX_EMBEDDING_INPUTS texts or token-id lists.
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None  # the first N values, renormalised (Matryoshka-trained models)
    user: str | None = None


# Inputs in one /v1/embeddings request (each is one engine request, queued like any other).
MAX_EMBEDDING_INPUTS = 512

# The shapes prompt_inputs and /generate's input_ids accept, for the OpenAPI document (openapi.py).
PROMPT_IDS_SCHEMA = {"type": "array", "minItems": 1, MODEL_LIMIT: "context",
                     "items": {"type": "integer", "minimum": 0, MODEL_LIMIT: "vocab"}}
PROMPT_IDS_BATCH_SCHEMA = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH, "items": PROMPT_IDS_SCHEMA}
TEXTS_SCHEMA = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH, "items": {"type": "string", "minLength": 1}}
PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, TEXTS_SCHEMA, PROMPT_IDS_SCHEMA, PROMPT_IDS_BATCH_SCHEMA]}
EMBEDDING_INPUT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                                    {**TEXTS_SCHEMA, "maxItems": MAX_EMBEDDING_INPUTS}, PROMPT_IDS_SCHEMA,
                                    {**PROMPT_IDS_BATCH_SCHEMA, "maxItems": MAX_EMBEDDING_INPUTS}]}


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as a `kind` Struct, or a 400 naming what is wrong. As in JSON Schema (and JSON
    itself), a number with no fractional part is an integer: 5.0 is accepted where 5 is."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as err:
            if "got `float`" not in str(err):  # an int field (or int | None) given 5.0
                raise
            return msgspec.convert(_whole_floats_as_ints(msgspec.json.decode(body)), type=kind)
    except msgspec.ValidationError as err:
        param = str(err).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(err) else None
        raise ApiError(400, f"invalid request: {err}", param) from err
    except msgspec.DecodeError as err:
        raise ApiError(400, f"malformed JSON: {err}") from err
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start})") from err
    except RecursionError:
        raise ApiError(400, "the request body's JSON is nested too deeply") from None


def _whole_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def check_nesting(value: Any, param: str, depth: int = 0) -> None:
    """Refuse free-form JSON nested deeper than MAX_NESTING before anything recurses into it."""
    if depth > MAX_NESTING:
        raise ApiError(400, f"{param} is nested more than {MAX_NESTING} levels deep", param)
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        check_nesting(child, param, depth + 1)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    if any(t >= vocab_size for t in ids):
        raise ApiError(400, f"{param} must be token ids below the vocabulary size {vocab_size}", param)


def sampling_params(
    req, vocab_size: int, logprobs: int | None = None, prompt_logprobs: int | None = None, lora_id: int = 0
) -> SamplingParams:
    """The engine's SamplingParams from a decoded request (ranges were checked while decoding; here the
    limits of the served model). max_tokens is set per prompt by pipeline.serve."""
    keys = (req.logit_bias or {}).keys()
    # The schema's pattern ends in `$`, which Python (not JSON Schema) also lets match before a final "\n".
    if not all(key.isascii() and key.isdigit() for key in keys):
        raise ApiError(400, "logit_bias keys must be token ids written as decimal digits", "logit_bias")
    bias = {int(key): value for key, value in req.logit_bias.items()} if keys else {}
    check_token_ids(bias, vocab_size, "logit_bias")
    stop_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias or None,
        seed=req.seed,
        min_tokens=req.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        lora_id=lora_id,
    )


def prompt_inputs(prompt: str | list, vocab_size: int, param: str = "prompt",
                  max_batch: int = MAX_BATCH) -> list[str | list[int]]:
    """PROMPT_SCHEMA's four forms -> a list of prompts, each a non-empty string or list of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        prompts = prompt
    else:
        raise ApiError(400, f"{param} must be a string, a list of strings, a list of token ids or a list of those",
                       param)
    if len(prompts) > max_batch:
        raise ApiError(400, f"{param} may hold at most {max_batch} prompts", param)
    if any(not p for p in prompts):
        raise ApiError(400, f"a prompt in {param} is empty", param)
    for p in prompts:
        if isinstance(p, list):
            if any(t < 0 for t in p):
                raise ApiError(400, f"{param} token ids must not be negative", param)
            check_token_ids(p, vocab_size, param)
    return prompts


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content parts as {"type": "text", "text"},
    {"type": "image"} and {"type": "video"} (the renderer joins text parts for a template that reads
    strings only), and no content as an empty string (templates concatenate it)."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                       else {"type": "image" if isinstance(part, ImagePart) else "video"} for part in content]
        item = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": arguments_object(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """Every image part's URL in prompt order, with where it is (messages[i].content[j])."""
    return [(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, message in enumerate(messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if isinstance(part, ImagePart)]


def video_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """Every video part's URL in prompt order, with where it is (messages[i].content[j])."""
    return [(f"messages[{i}].content[{j}]", part.video_url.url)
            for i, message in enumerate(messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if isinstance(part, VideoPart)]


def arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """The object templates expect (as transformers' tool-use convention), or the text as sent when it
    is not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def function_tool(name: str, description: str | None = None, parameters: dict[str, Any] | None = None,
                  strict: bool | None = None) -> dict[str, Any]:
    """A function tool as the chat template and the tool-call grammar read it (unset fields left out),
    whichever API described it."""
    fields = (("name", name), ("description", description), ("parameters", parameters), ("strict", strict))
    return {"type": "function", "function": {key: value for key, value in fields if value is not None}}


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [function_tool(**msgspec.structs.asdict(t.function)) for t in tools]
