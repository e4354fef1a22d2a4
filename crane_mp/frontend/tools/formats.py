"""The tool-call formats the supported models write, which one a server reads, the prompt that describes
tools to a template that does not, and the checks on a request's tools and tool_choice.

Five formats cover the supported models: Hermes (`<tool_call>{"name": .., "arguments": ..}</tool_call>`,
Qwen2.5, Qwen3 and most fine-tunes), Qwen3-Coder's XML (`<tool_call><function=..><parameter=..>..
</parameter></function></tool_call>`, tools/xml_calls.py), Llama 3's JSON (`{"name": .., "parameters": ..}`,
calls separated by `;`), Mistral's (`[TOOL_CALLS][{"name": .., "arguments": ..}, ..]`; the marker is a
control token, gone from the text, so a leading `[` opens the calls too), Granite's (`<|tool_call|>`
and the same list; Phi-4-mini writes it too), Gemma 4's (`<|tool_call>call:NAME{key:<|"|>text<|"|>}
<tool_call|>`, tools/gemma4_calls.py) and gpt-oss's harmony messages (`<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`, tools/harmony_calls.py).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from crane_mp.frontend.serving.harmony import CALL, CALL_OPEN, CHANNEL, CONSTRAIN, MESSAGE
from crane_mp.frontend.web.errors import ApiError


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str  # the --tool-call-parser value
    markers: tuple[str, ...]  # texts that open the tool calls anywhere in the output
    leading: str  # the calls also start where the output's first non-space character is one of these
    arguments_keys: tuple[str, ...]  # the call object's keys for the arguments; the first is written when forced
    call_open: str = ""  # the forced grammar's text around each call and between calls
    call_close: str = ""
    separator: str = ""
    list_open: str = ""
    list_close: str = ""
    id_length: int = 0  # Mistral's templates insist on 9-character call ids; 0: OpenAI's call_<hex>
    xml: bool = False  # Qwen3-Coder's calls: a function element of parameter elements, not a JSON object
    gemma: bool = False  # Gemma 4's calls: call:NAME{...} of its own syntax, not a JSON object
    harmony: bool = False  # gpt-oss's: commentary-channel messages to functions.NAME (tools/harmony_calls.py)


# gpt-oss's token that ends a call message (its harmony format, serving/harmony.py), and the tags a
# forced call is written with.
HARMONY_CALL = CALL
HARMONY_CALL_TAGS = (CHANNEL, CONSTRAIN, MESSAGE, CALL)
# Gemma 4's call marks: a call's start and end, and the quote around its strings (tools/gemma4_calls.py).
GEMMA4_MARKS = ("<|tool_call>", "<tool_call|>", '<|"|>')

FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), "", ("arguments",),
                         call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n"),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), "{", ("parameters", "arguments"), separator="; "),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), "[", ("arguments",),
                          separator=", ", list_open="[TOOL_CALLS][", list_close="]", id_length=9),
    "granite": ToolFormat("granite", ("<|tool_call|>",), "", ("arguments",), separator=", ",
                          list_open="<|tool_call|>[", list_close="]"),
    "qwen3_coder": ToolFormat("qwen3_coder", ("<tool_call>",), "", ("arguments",),
                              call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n", xml=True),
    "gemma4": ToolFormat("gemma4", GEMMA4_MARKS[:1], "", ("arguments",), call_open=GEMMA4_MARKS[0],
                         call_close=GEMMA4_MARKS[1], gemma=True),
    "openai": ToolFormat("openai", (CALL_OPEN,), "", ("arguments",), harmony=True),
}
# Texts of the formats that a vocabulary may hold as one (added) token.
MARKER_TEXTS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", *GEMMA4_MARKS,
                *HARMONY_CALL_TAGS)
# --tool-call-parser auto: the format whose marker the vocabulary holds as a token, else by architecture
# (a Mistral GGUF says "llama"; fine-tunes of other families mostly follow Hermes).
_BY_MARKER = {HARMONY_CALL: "openai", GEMMA4_MARKS[0]: "gemma4", "[TOOL_CALLS]": "mistral", "<tool_call>": "hermes",
              "<|python_tag|>": "llama3_json", "<|tool_call|>": "granite"}
_BY_ARCH = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral", "granite": "granite",
            "granite4": "granite", "phi3": "granite", "gemma4": "gemma4", "gpt_oss": "openai"}


def tool_format(parser: str, arch: str, marker_tokens: dict[str, int] | None = None,
                xml_template: bool = False) -> ToolFormat | None:
    """The format of --tool-call-parser (`auto`: Qwen3-Coder's where the chat template writes calls as
    XML (`xml_template`), else by the vocabulary's markers, then the architecture); None for `none`."""
    if parser == "none":
        return None
    if parser != "auto":
        return FORMATS[parser]
    if xml_template:
        return FORMATS["qwen3_coder"]
    for marker, name in _BY_MARKER.items():
        if marker in (marker_tokens or {}):
            return FORMATS[name]
    return FORMATS[_BY_ARCH.get(arch, "hermes")]


def new_call_id(fmt: ToolFormat) -> str:
    if fmt.id_length:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(fmt.id_length))
    return f"call_{secrets.token_hex(12)}"


def tool_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """Tool definitions and the expected call format, for a chat template that does not render tools."""
    example = json.dumps({"name": "NAME", fmt.arguments_keys[0]: {"ARGUMENT": "VALUE"}})
    if fmt.xml:
        example = "<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>"
    if fmt.gemma:
        example = 'call:NAME{ARGUMENT:<|"|>VALUE<|"|>}'
    call = f"{fmt.list_open}{fmt.call_open}{example}{fmt.call_close}{fmt.list_close}"
    listing = "\n".join(json.dumps(tool["function"]) for tool in tools)
    return f"You can call these functions, described as JSON:\n{listing}\nTo call one, answer with only:\n{call}"


def check_tools(tools: list[dict] | None, tool_choice, fmt: ToolFormat | None) -> tuple[str, str | None]:
    """(mode, named function) for a chat request: mode none | auto | required | named; 400s for a
    choice that cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return "none", None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools must have distinct function names", "tools")
    if tool_choice is None:
        tool_choice = "auto"
    if not isinstance(tool_choice, str):  # {"type": "function", "function": {"name": ...}}
        name = tool_choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        mode, only = "named", name
    else:
        mode, only = tool_choice, None
    if mode != "none" and fmt is None:
        raise ApiError(400, "this server reads no tool calls (--tool-call-parser none); use tool_choice none",
                       "tool_choice")
    return mode, only
