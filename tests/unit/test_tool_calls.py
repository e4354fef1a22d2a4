"""Tool-call parsing in each format (Qwen3-Coder's XML too, its values typed by the tools' schemas),
whole and streamed piece by piece (the same calls either way), and the grammars that force a call:
they admit a well-formed call and nothing else."""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher

from crane_mp.frontend.openai.schemas import NamedFunction, NamedToolChoice
from crane_mp.frontend.serving.answers import ToolReading
from crane_mp.frontend.serving.structured import to_grammar
from crane_mp.frontend.serving.tokenizer import writes_xml_calls
from crane_mp.frontend.tools.forcing import forced_call_constraint
from crane_mp.frontend.tools.formats import FORMATS, check_tools, tool_format
from crane_mp.frontend.tools.parser import ToolCallParser, parse_tool_calls, parse_with
from crane_mp.frontend.web.errors import ApiError
from crane_mp.model_tokenizer import grammar_tokenizer, load_tokenizer
from crane_mp.testing.make_model import make_model

HERMES, LLAMA, MISTRAL, GRANITE = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"], FORMATS["granite"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}

CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": 'Paris, "FR" {x}'}), ("add", {"a": 1, "b": [2, {"c": 3}]})]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {"a": 2, "b": 3}}',
     None, [("get_weather", {"city": "Oslo"}), ("add", {"a": 2, "b": 3})]),
    (LLAMA, '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    (MISTRAL, ' [{"name": "add", "arguments": {"a": 5, "b": 6}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     None, [("add", {"a": 5, "b": 6}), ("get_weather", {"city": "Rome"})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]', None, [("add", {"a": 5, "b": 6})]),
    # Granite 3/4 (and Phi-4-mini): a marker token, then Mistral's list.
    (GRANITE, 'Sure.<|tool_call|>[{"name": "add", "arguments": {"a": 5, "b": 6}}, {"name": "get_weather", '
              '"arguments": {"city": "Rome"}}]', "Sure.",
     [("add", {"a": 5, "b": 6}), ("get_weather", {"city": "Rome"})]),
    # Llama 3 models also write "arguments"; braces in text after a call are not a call.
    (LLAMA, '{"name": "add", "arguments": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    (HERMES, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> Note {see above}', None,
     [("add", {"a": 1})]),
    # Arguments given as a JSON string holding the object, and the name after the arguments.
    (HERMES, '<tool_call>{"arguments": "{\\"city\\": \\"Lima\\"}", "name": "get_weather"}</tool_call>', None,
     [("get_weather", {"city": "Lima"})]),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_output_is_read_into_calls(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(calls)
    if fmt is MISTRAL:
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
    else:
        assert all(c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_pieces_add_up_to_the_same_calls(fmt, text, content, calls, seed):
    streamed_content, streamed_calls = stream_through(ToolCallParser(fmt), text, random.Random(seed), 7)
    assert streamed_content.strip() == (content or "")
    assert streamed_calls == calls


def stream_through(parser: ToolCallParser, text: str, rng: random.Random, longest: int) -> tuple[str, list]:
    """`text` fed in random pieces of 1 to `longest` characters -> (content, [(name, arguments)]) rebuilt
    from the deltas, each call opened once."""
    content, items, position = "", [], 0
    while position < len(text):
        size = rng.randint(1, longest)
        piece, deltas = parser.feed(text[position : position + size])
        content, items, position = content + piece, items + deltas, position + size
    rest, more = parser.finish()
    rebuilt: dict[int, dict] = {}
    for item in items + more:
        call = rebuilt.setdefault(item["index"], {"name": None, "arguments": ""})
        if "id" in item:
            assert call["name"] is None, "a call is opened once"
            call["name"] = item["function"]["name"]
        call["arguments"] += item["function"]["arguments"]
    return content + rest, [(c["name"], json.loads(c["arguments"])) for c in rebuilt.values()]


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(HERMES)
    _, first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first == [{"index": 0, "id": parser.calls[0].id, "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]
    _, second = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert second == [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]


@pytest.mark.parametrize("text", [
    "Just an answer, no call.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut off by max_tokens
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    "The JSON {\"name\": \"add\"} appears inside text.",  # llama3_json: not leading, so not a call
])
def test_anything_but_well_formed_calls_stays_content(text):
    fmt = LLAMA if text.startswith("The JSON") else HERMES
    assert parse_tool_calls(fmt, text) == (text, None)


@pytest.mark.parametrize("fmt,text", [(HERMES, "Well <tool_call> I cannot call anything </tool_call>"),
                                      (LLAMA, "{not a call at all")])
def test_a_calls_region_without_a_call_is_streamed_as_content_at_the_end(fmt, text):
    parser = ToolCallParser(fmt)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    assert content + rest == text and calls == more == []


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>',  # an escape JSON does not have
    '<tool_call>{"name": "f", "arguments": "{\'city\': \'Paris\'}"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "tab\there"}</tool_call>',  # a raw tab inside a string
])
def test_invalid_json_from_the_model_is_content_not_a_crash(text):
    content, calls = parse_tool_calls(HERMES, text)
    assert calls is None or all(json.loads(c["function"]["arguments"]) is not None for c in calls)
    parser = ToolCallParser(HERMES)
    for char in text:
        parser.feed(char)
    parser.finish()


def test_auto_picks_the_format_whose_marker_the_vocabulary_holds():
    assert tool_format("auto", "llama", {"[TOOL_CALLS]": 5}) is MISTRAL
    assert tool_format("auto", "llama", {"<tool_call>": 9, "</tool_call>": 10}) is HERMES
    assert tool_format("auto", "llama", {}) is LLAMA and tool_format("mistral", "qwen3", {}) is MISTRAL
    assert tool_format("auto", "granite", {"<|tool_call|>": 7}) is GRANITE
    assert tool_format("auto", "granite4") is GRANITE
    assert tool_format("auto", "gemma3", {}) is HERMES  # no format of its own: what most fine-tunes write


def test_only_the_first_call_when_parallel_calls_are_off():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": {}}</tool_call>'
    _, calls = parse_tool_calls(HERMES, text, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["add"]


def test_a_partial_marker_is_held_back_until_it_resolves():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("kit and more") == ("<toolkit and more", [])


def test_tool_choice_checks():
    fmt = tool_format("auto", "qwen3")
    assert fmt is HERMES and tool_format("auto", "llama") is LLAMA and tool_format("none", "qwen3") is None
    assert check_tools([WEATHER], None, fmt) == ("auto", None)
    assert check_tools(None, None, fmt) == ("none", None)
    assert check_tools([WEATHER, ADD], NamedToolChoice("function", NamedFunction("add")), fmt) == ("named", "add")
    for tools, choice, parser, message in [
        (None, "required", fmt, "needs tools"),
        ([WEATHER], NamedToolChoice("function", NamedFunction("nope")), fmt, "not among the tools"),
        ([WEATHER, WEATHER], "auto", fmt, "distinct"),
        ([WEATHER], "auto", None, "--tool-call-parser none"),
    ]:
        with pytest.raises(ApiError, match=message):
            check_tools(tools, choice, parser)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    tokenizer = load_tokenizer(str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "q")))
    markers = {text: tokenizer.convert_tokens_to_ids(text) for text in ("<tool_call>", "</tool_call>")}
    return tokenizer, grammar_tokenizer(tokenizer, 512, [507]), markers


@pytest.mark.parametrize("only,parallel", [(None, True), ("add", False)])
def test_a_forced_call_grammar_admits_calls_of_the_offered_tools_only(vocabulary, only, parallel):
    tokenizer, ll_tokenizer, markers = vocabulary
    grammar = to_grammar(forced_call_constraint(HERMES, [WEATHER, ADD], only, parallel, markers))
    assert LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer) == (False, [])

    def admitted(text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert admitted(add)
    assert admitted(weather) is (only is None)
    assert admitted(add + "\n" + weather) is parallel
    assert not admitted('<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert not admitted('<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>')
    assert not admitted("Sure! " + add)


def test_a_forced_call_resolves_the_references_of_each_tools_own_schema(vocabulary):
    tokenizer, ll_tokenizer, markers = vocabulary
    nested = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "$defs": {"Address": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                              "required": ["city"], "additionalProperties": False}}}}}
    grammar = to_grammar(forced_call_constraint(HERMES, [nested, ADD], None, True, markers))
    assert LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer) == (False, [])
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    good = '<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}\n</tool_call>'
    assert matcher.consume_tokens(tokenizer.encode(good, add_special_tokens=False)) and matcher.is_accepting()
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    bad = '<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Rome"}}}\n</tool_call>'
    assert not (matcher.consume_tokens(tokenizer.encode(bad, add_special_tokens=False)) and matcher.is_accepting())


CODER = FORMATS["qwen3_coder"]
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
    "opts": {"type": "object"}, "maybe": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
XML_TEXT = ("Running both.\n<tool_call>\n<function=typed>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n"
            "</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=opts>\n{\"k\": {\"v\": null}}\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
            "<parameter=code>\nif a < b:\n    print(\"<x>\")\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
XML_CALLS = [("typed", {"n": 42, "x": 2.5, "ok": True, "tags": ["a", 1], "opts": {"k": {"v": None}}, "maybe": None,
                        "code": 'if a < b:\n    print("<x>")'}),
             ("get_weather", {"city": "Paris"})]


def xml_reading(parallel: bool = True) -> ToolReading:
    return ToolReading(CODER, parallel, [TYPED, WEATHER])


def test_qwen3_coder_xml_calls_are_read_with_their_schemas_types():
    content, calls = parse_with(xml_reading().parser(), XML_TEXT)
    assert content == "Running both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == XML_CALLS
    assert all(c["id"].startswith("call_") for c in calls)
    # A value that does not parse as its type stays the text; a parameter no schema names is a string.
    text = "<tool_call>\n<function=typed>\n<parameter=n>\nmany\n</parameter>\n<parameter=extra>\n7\n</parameter>\n" \
           "<parameter=x>\n1e999\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_with(xml_reading().parser(), text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": "many", "extra": "7", "x": "1e999"}
    _, calls = parse_with(xml_reading().parser(), "<tool_call>\n<function=typed>\n</function>\n</tool_call>")
    assert calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("seed", range(6))
def test_qwen3_coder_xml_calls_stream_to_the_same_calls(seed):
    parser = xml_reading().parser()
    content, calls = stream_through(parser, XML_TEXT, random.Random(seed), 9)
    assert content.strip() == "Running both." and parser.well_formed
    assert calls == XML_CALLS


def test_qwen3_coder_xml_arguments_stream_a_parameter_at_a_time():
    parser = xml_reading().parser()
    _, first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert first == [{"index": 0, "id": parser.calls[0].id, "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    _, second = parser.feed("is\n</parameter>\n")
    assert second == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]
    _, third = parser.feed("</function>\n</tool_call>")
    assert third == [{"index": 0, "function": {"arguments": "}"}}]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # cut off by max_tokens
    "No call, just <function=words> in text.",
])
def test_qwen3_coder_xml_that_is_not_a_whole_call_stays_content(text):
    assert parse_with(xml_reading().parser(), text) == (text, None)


def test_qwen3_coder_only_the_first_call_when_parallel_calls_are_off():
    _, calls = parse_with(xml_reading(parallel=False).parser(), XML_TEXT)
    assert [c["function"]["name"] for c in calls] == ["typed"]


def test_auto_picks_qwen3_coder_where_the_chat_templatewrites_xml_calls():
    markers = {"<tool_call>": 9, "</tool_call>": 10}
    assert tool_format("auto", "qwen3", markers, xml_template=True) is CODER
    assert tool_format("auto", "qwen3", markers) is HERMES and tool_format("hermes", "qwen3", {}, True) is HERMES
    assert writes_xml_calls("{{ '<function=' + name + '>' }}<parameter={{ p }}>")
    assert not writes_xml_calls({"default": "<tool_call>{{ tool | tojson }}</tool_call>"})
    assert not writes_xml_calls(None)


@pytest.mark.parametrize("only,parallel", [(None, True), ("add", False)])
def test_a_forced_xml_call_grammar_admits_calls_of_the_offered_tools_only(vocabulary, only, parallel):
    tokenizer, ll_tokenizer, markers = vocabulary
    unit = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
    grammar = to_grammar(forced_call_constraint(CODER, [unit, ADD], only, parallel, markers))
    assert LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer) == (False, [])

    def admitted(text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    def call(name: str, **values: str) -> str:
        parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"

    add, weather = call("add", a="1", b="-2"), call("get_weather", city="Paris <FR>\nsays hi", unit="c")
    assert admitted(add)
    assert admitted(weather) is (only is None)
    assert admitted(call("get_weather", city="Oslo")) is (only is None)
    assert admitted(add + "\n" + weather) is parallel
    assert not admitted(call("add", a="one", b="2"))
    assert not admitted(call("add", a="1"))  # a required parameter left out
    assert not admitted(call("get_weather", city="Oslo", unit="k"))
    assert not admitted(call("sub", a="1", b="2"))
    assert not admitted("Sure! " + add)


GEMMA4 = FORMATS["gemma4"]
Q = '<|"|>'
GEMMA4_TEXT = (f"Checking.<|tool_call>call:get_weather{{city:{Q}Paris, {{FR}} [x]: y{Q},days:3,"
               f"units:{{metric:true,scale:-2.5e1}},tags:[{Q}a{Q},{{k:null}},[]],{Q}odd key{Q}:false}}<tool_call|>"
               f"<|tool_call>call:add{{}}<tool_call|>")
GEMMA4_CALLS = [("get_weather", {"city": "Paris, {FR} [x]: y", "days": 3, "units": {"metric": True, "scale": -25.0},
                                 "tags": ["a", {"k": None}, []], "odd key": False}), ("add", {})]


def test_gemma4_calls_are_read_into_json_arguments():
    reading = ToolReading(GEMMA4)
    content, calls = parse_with(reading.parser(), GEMMA4_TEXT)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == GEMMA4_CALLS
    _, calls = parse_with(ToolReading(GEMMA4, parallel=False).parser(), GEMMA4_TEXT)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("seed", range(8))
def test_gemma4_calls_stream_to_the_same_calls(seed):
    parser = ToolReading(GEMMA4).parser()
    content, calls = stream_through(parser, GEMMA4_TEXT, random.Random(seed), 6)
    assert content == "Checking." and parser.well_formed
    assert calls == GEMMA4_CALLS


def test_gemma4_sends_a_call_s_name_once_whole_and_its_arguments_once_it_closes():
    parser = ToolReading(GEMMA4).parser()
    assert parser.feed("<|tool_call>call:get_wea") == ("", [])
    _, named = parser.feed(f"ther{{city:{Q}Pa")
    assert named == [{"index": 0, "id": parser.calls[0].id, "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    assert parser.feed(f"ris{Q}}}<tool_") == ("", [])
    _, closed = parser.feed("call|>")
    assert closed == [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("text", [
    f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}",  # cut off by max_tokens
    "<|tool_call>call:get_weather{city:}<tool_call|>",  # a key without a value
    "<|tool_call>get_weather{}<tool_call|>",  # no call: prefix
    f"<|tool_call>call:add{{a:1 b:2}}<tool_call|>",  # no comma between pairs
    "Plain text that mentions call:add{a:1}.",
])
def test_gemma4_text_that_is_not_a_whole_call_stays_content(text):
    assert parse_with(ToolReading(GEMMA4).parser(), text) == (text, None)


def test_auto_picks_gemma4_by_its_marker_or_architecture():
    assert tool_format("auto", "llama", {"<|tool_call>": 48, "<tool_call|>": 49}) is GEMMA4
    assert tool_format("auto", "gemma4", {}) is GEMMA4


@pytest.mark.parametrize("quote_is_token", [True, False])
@pytest.mark.parametrize("only,parallel", [(None, True), ("get_weather", False)])
def test_a_forced_gemma4_call_grammar_admits_typed_calls_of_the_offered_tools_only(only, parallel, quote_is_token,
                                                                                   tmp_path):
    from tokenizers import AddedToken

    tokenizer = load_tokenizer(str(make_model("qwen3", "tiny", tmp_path / "q")))
    marks = ["<|tool_call>", "<tool_call|>"] + (['<|"|>'] if quote_is_token else [])
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(m, normalized=False) for m in marks]})
    markers = {mark: tokenizer.convert_tokens_to_ids(mark) for mark in marks}
    ll_tokenizer = grammar_tokenizer(tokenizer, 512, [507])
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
        "required": ["city"]}}}
    grammar = to_grammar(forced_call_constraint(GEMMA4, [weather, ADD], only, parallel, markers))
    assert LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer) == (False, [])

    def admitted(text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    call = f"<|tool_call>call:get_weather{{city:{Q}Oslo, <NO>{Q},unit:{Q}c{Q},where:{{lat:-1.5e2}}}}<tool_call|>"
    add = "<|tool_call>call:add{a:1,b:2}<tool_call|>"
    assert admitted(call) and admitted(f"<|tool_call>call:get_weather{{city:{Q}x{Q},days:3}}<tool_call|>")
    assert parse_with(ToolReading(GEMMA4).parser(), call)[1] is not None  # what the grammar admits reads back
    assert admitted(add) is (only is None)
    assert admitted(call + call) is parallel
    assert not admitted(f"<|tool_call>call:get_weather{{days:3}}<tool_call|>")  # city is required
    assert not admitted(f"<|tool_call>call:get_weather{{city:{Q}x{Q},unit:{Q}k{Q}}}<tool_call|>")  # not in the enum
    assert not admitted(f"<|tool_call>call:get_weather{{unit:{Q}c{Q},city:{Q}x{Q}}}<tool_call|>")  # schema order
    assert not admitted(f"<|tool_call>call:get_weather{{city:{Q}x{Q},days:2.5}}<tool_call|>")  # not an integer
    assert not admitted("Sure! " + call)
