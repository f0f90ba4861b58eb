"""The Action protocol without a model: grammar construction, the repair layer's parser, tool config checks."""

from __future__ import annotations

import pytest

from magnitude.toolcall import ActionError, ActionParser, action_grammar, action_schema
from services.tools.builtins import SCHEMAS
from shared.config import ConfigError, parse_config

TOOLS = [{"name": n, "parameters": s} for n, s in SCHEMAS.items()] + [
    {"name": "set_timer", "parameters": {"type": "object", "required": ["minutes"], "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 5}, "label": {"type": "string"}}}}]


def test_grammar_names_every_tool_and_enforces_what_the_converter_drops():
    grammar = action_grammar(TOOLS)
    for name in ("calculator", "file_reader", "memory_search", "set_timer", "final_answer"):
        assert f'"\\"{name}\\""' in grammar
    assert '"1" | "2" | "3" | "4" | "5"' in grammar  # integer range as an enum
    assert r'char ::= [^"\\\x00-\x1F]' in grammar  # no raw control characters in strings
    label = action_schema(TOOLS)["anyOf"][3]["properties"]["args"]["properties"]["label"]
    assert label["maxLength"] == 200  # unbounded strings get a bound


@pytest.mark.parametrize("text, action", [
    ('{"tool": "calculator", "args": {"expression": "1+1"}}', ("calculator", {"expression": "1+1"})),
    ('Action: {"tool": "final_answer", "args": {"answer": "4"}} and more', ("final_answer", {"answer": "4"})),
    ('Thought: x\nAction: {"tool": "set_timer", "args": {"minutes": 3}}', ("set_timer", {"minutes": 3})),
])
def test_parser_extracts_valid_actions(text, action):
    parsed = ActionParser(TOOLS).parse(text)
    assert (parsed["tool"], parsed["args"]) == action


@pytest.mark.parametrize("text, why", [
    ("Action: 23 * 47", "no JSON object"),
    ('Action: {"tool": "calculator", "args": {', "not valid JSON"),
    ('Action: {"tool": "calc", "args": {}}', "unknown tool 'calc'"),
    ('Action: {"tool": "calculator"}', 'exactly "tool" and "args"'),
    ('Action: {"tool": "calculator", "args": {}}', "'expression' is a required property"),
    ('Action: {"tool": "set_timer", "args": {"minutes": 9}}', "minutes: 9 is greater than the maximum of 5"),
])
def test_parser_says_what_is_wrong(text, why):
    with pytest.raises(ActionError, match=why):
        ActionParser(TOOLS).parse(text)


@pytest.mark.parametrize("tools, why", [
    ([{"name": "calculator"}, {"name": "calculator"}], "declared twice"),
    ([{"name": "final_answer", "kind": "shell", "target": "x", "parameters": {"type": "object"}}], "reserved"),
    ([{"name": "web"}], "no builtin tool 'web'"),
    ([{"name": "x", "kind": "python", "target": "nocolon", "parameters": {"type": "object"}}], "module:function"),
    ([{"name": "x", "kind": "shell", "target": "ls", "parameters": {"type": "array"}}], "type: object"),
    ([{"name": "x", "kind": "shell", "target": "ls", "parameters": {"type": "object"},
       "limits": {"memory_mb": 1}}], "memory_mb"),
    ([{"name": "Bad-Name"}], "pattern"),
])
def test_tool_config_is_checked_at_load(tools, why):
    with pytest.raises(ConfigError, match=why):
        parse_config({"agent": {"tools": tools}})
