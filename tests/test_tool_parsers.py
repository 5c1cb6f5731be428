"""Tool-call parsers (hermes, llama3_json, mistral; named and required): whole replies and streamed ones.

A streamed reply, fed in pieces of any size, must add up to what the whole reply parses to, with
OpenAI's delta shapes (a call's first delta has its id and name, later ones only argument text);
text that is not a well-formed call is plain content. No engine: fast.
"""

from __future__ import annotations

import json

import pytest

from vllm_lite.entrypoints.openai.tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolCallStreamer,
    ToolParser,
    ToolParserManager,
)
from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, scan_value


def parser(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)()


def stream(p: ToolParser, text: str, piece: int) -> tuple[str, list[dict], list]:
    """Feed `text` in pieces of `piece` characters; returns (content, calls as {id, name, arguments}, deltas)."""
    streamer = ToolCallStreamer(p)
    deltas = [streamer.feed(text[i : i + piece]) for i in range(0, len(text), piece)] + [streamer.finish()]
    content, calls = "", []
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            if tc.index == len(calls):
                assert tc.id and tc.name is not None, "a call's first delta carries its id and name"
                calls.append({"id": tc.id, "name": tc.name, "arguments": tc.arguments})
            else:
                assert tc.id is None and tc.name is None, "later deltas carry argument text only"
                calls[tc.index]["arguments"] += tc.arguments
    return content, calls, deltas


def whole(p: ToolParser, text: str) -> tuple[bool, list[dict], object]:
    info = p.extract_tool_calls(text)
    return (
        info.tools_called,
        [{"name": c.name, "arguments": json.loads(c.arguments)} for c in info.tool_calls],
        info.content,
    )


HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}\\"b{"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": [1, 2]}}; {"name": "t", "parameters": {}}'
MISTRAL = 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "t", "arguments": {}}]'
EXPECTED = {
    "hermes": (
        HERMES,
        "Let me check. ",
        [
            {"name": "get_weather", "arguments": {"city": "Paris", "note": 'a}"b{'}},
            {"name": "get_time", "arguments": {}},
        ],
    ),
    "llama3_json": (
        LLAMA3,
        None,
        [{"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}, {"name": "t", "arguments": {}}],
    ),
    "mistral": (
        MISTRAL,
        "Sure ",
        [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "t", "arguments": {}}],
    ),
}


def test_registry_has_vllms_parser_names_and_refuses_unknown_ones():
    assert {"hermes", "llama3_json", "mistral"} <= set(ToolParserManager.names())
    with pytest.raises(KeyError, match="hermes"):
        ToolParserManager.get_tool_parser("no-such-parser")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_whole_reply_gives_its_calls_and_the_text_before_them(name):
    text, content, calls = EXPECTED[name]
    assert whole(parser(name), text) == (True, calls, content)


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_streamed_reply_adds_up_to_the_whole_reply(name, piece):
    text, content, calls = EXPECTED[name]
    got_content, got_calls, _ = stream(parser(name), text, piece)
    assert got_content == (content or "")
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(calls)


def test_streamed_arguments_come_in_fragments_after_the_name():
    _, calls, deltas = stream(parser("hermes"), HERMES, 1)
    first = [tc for d in deltas for tc in d.tool_calls if tc.index == 0]
    assert first[0].name == "get_weather" and first[0].arguments == ""
    assert len(first) > 10 and all(tc.name is None for tc in first[1:])


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", "no calls here, just <b>text</b> and a < sign"),
        ("hermes", "<tool_call>this is not JSON</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        ("llama3_json", "The weather is fine."),
        ("mistral", "[TOOL_CALLS] not a list"),
    ],
)
def test_malformed_or_absent_calls_are_plain_content(name, text):
    assert whole(parser(name), text) == (False, [], text)
    content, calls, _ = stream(parser(name), text, 2)
    assert content == text and calls == []


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": {}} and more words'),
    ],
)
def test_text_found_malformed_after_a_call_was_streamed_keeps_the_call_and_arrives_as_content(name, text):
    assert whole(parser(name), text) == (False, [], text)
    content, calls, _ = stream(parser(name), text, 2)
    assert content == text  # nothing is lost; a streamed call cannot be taken back
    assert [c["name"] for c in calls] == ["f"]


def test_a_possible_marker_is_held_back_until_it_is_decided():
    streamer = ToolCallStreamer(parser("hermes"))
    assert streamer.feed("Hi <tool").content == "Hi "
    assert streamer.feed("box>").content == "<toolbox>"
    streamer = ToolCallStreamer(parser("hermes"))
    streamer.feed("Hi <tool")
    assert streamer.finish().content == "<tool"  # the reply ended: nothing more can come


def test_a_call_cut_short_by_max_tokens_is_content_in_the_whole_reply():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1'
    assert whole(parser("hermes"), text) == (False, [], text)


def test_named_choice_output_is_that_functions_arguments():
    p = NamedToolCallParser("get_weather")
    assert whole(p, '{"city": "Paris"}') == (True, [{"name": "get_weather", "arguments": {"city": "Paris"}}], None)
    _, calls, _ = stream(p, '{"city": "Paris"}', 4)
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Paris"}'


def test_required_choice_output_is_an_array_of_name_and_parameters():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"parameters": {"y": [2]}, "name": "b"}]'
    expected = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [2]}}]
    assert whole(RequiredToolCallsParser(), text) == (True, expected, None)
    _, calls, _ = stream(RequiredToolCallsParser(), text, 5)
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == expected


def test_scanner_reports_incomplete_values_and_refuses_malformed_ones():
    assert scan_value('"a\\"b"x', 0) == 6
    assert scan_value('{"a": [1, "]"]', 0) is None  # not closed yet
    assert scan_value("12", 0) is None  # a number at the end may still grow
    scan = scan_object('{"name": "f", "arguments": {"k": "v"', 0)
    assert scan.end is None and scan.fields["name"].end is not None and scan.fields["arguments"].end is None
    for bad in ('{"a" 1}', '{"a": 1 "b": 2}', "{'a': 1}", '{"a": [1}'):
        with pytest.raises(MalformedJSON):
            scan_object(bad, 0)
