"""Tool calls: the parser (tags, bare JSON, fences; arguments validated), streaming safety, the grammars' bounds,
and the lazy constraint on a real vocabulary (Qwen 2.5's, loaded without weights)."""

from __future__ import annotations

import json
import time

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals

from llama_cpp.llama_grammar import json_schema_to_gbnf
from shared.protocol import MAX_SCHEMA_DEPTH
from services.inference.constraint import (Constraint, LlamaGrammar, Vocabulary,
                                           _flatten_optional_chains, check_schema, gbnf_constraint,
                                           vocabulary)
from services.inference.tool_calls import scan, tagged_grammar, tool_table, triggers
from services.inference.grammar import nesting_depth
from shared.protocol import ProtocolError, decode_request, encode_request
from tests.conftest import CHAT_MODEL_PATH, require_model


def table(tools: list[dict]):
    """The tool table of a chat request's ``tools``, decoded as inference decodes them (their shape), then
    checked as schemas (``tool_table``)."""
    frame = encode_request("chat", {"messages": [{"role": "user"}], "tools": tools})
    return tool_table(decode_request(frame, max_frame_bytes=1 << 20, handled={"chat"}).message.tools)


TOOLS = table([
    {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
])
CALL = '{"name": "calculator", "arguments": {"expression": "2+2"}}'


@pytest.mark.parametrize("text, content", [
    (f"Let me compute.\n<tool_call>\n{CALL}\n</tool_call>", "Let me compute."),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>", ""),
    (f"  {CALL}", ""),
    (f"Sure:\n```json\n{CALL}\n```", "Sure:"),
    (f"```\n[{CALL}]\n```", ""),
    (f"<tool_call>\n{CALL}", ""),  # unclosed at the end of the reply: still a call
    ("{" + CALL + "}", ""),  # braces doubled, as in a Python format string: {{"name": ...}}} (the 1.5B)
    ("{" + CALL, ""),  # {{"name": ...}}
    ("```json\n{" + CALL + "}\n```", ""),
])
def test_calls_are_found_in_every_form_small_models_write(text, content):
    found = scan(text, TOOLS, final=True)
    assert found.content == content and found.calls
    assert all(c.name == "calculator" and json.loads(c.arguments) == {"expression": "2+2"} and c.error is None
               for c in found.calls)


@pytest.mark.parametrize("text", [
    '{"name": "Ada", "age": 36}',  # JSON, but not a call
    '```json\n{"name": "launch", "arguments": {}}\n```',  # bare and fenced forms must name a real tool
    "```python\nprint('<tool_call>')\n```",  # code mentioning the tag
    "Plain answer.",
])
def test_text_that_is_not_a_call_stays_content(text):
    assert scan(text, TOOLS, final=True).content == text and not scan(text, TOOLS, final=True).calls


def test_arguments_are_validated_and_a_bad_call_says_why():
    bad = scan('<tool_call>\n{"name": "calculator", "arguments": {"expr": 1}}\n</tool_call>', TOOLS, True).calls[0]
    assert bad.name == "calculator" and "expression" in bad.error
    unknown = scan('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', TOOLS, True).calls[0]
    assert "unknown tool 'launch'" in unknown.error
    garbled = scan("<tool_call>\nnot json\n</tool_call>", TOOLS, True).calls[0]
    assert garbled.error and garbled.arguments == '"not json"'
    as_string = scan('{"name": "read_file", "arguments": "{\\"path\\": \\"a.txt\\"}"}', TOOLS, True).calls[0]
    assert as_string.error is None and json.loads(as_string.arguments) == {"path": "a.txt"}


@pytest.mark.parametrize("text", [
    f"Let me compute.\n<tool_call>\n{CALL}\n</tool_call>",
    f"{CALL}",
    "{" + CALL + "}",
    f"Here:\n```json\n{CALL}\n```\n",
    "Code:\n```python\nx = 1\n```\nDone.  ",
    '{"name": "Ada"} is a JSON object',
])
def test_streamed_content_is_never_taken_back_and_never_shows_markup(text):
    final = scan(text, TOOLS, final=True)
    seen_calls = 0
    for end in range(len(text) + 1):
        partial = scan(text[:end], TOOLS, final=False)
        assert final.content.startswith(partial.content), (text[:end], partial.content)
        assert "<tool_call" not in partial.content and "```json" not in partial.content
        assert len(partial.calls) >= seen_calls
        seen_calls = len(partial.calls)
    assert seen_calls == len(final.calls) or text.startswith("{")  # a bare call is complete only at the end


@pytest.mark.parametrize("tools, says", [
    ([{"type": "function", "function": {"name": "has space"}}], r"'tools\[0\].function.name' must be str matching"),
    ([{"type": "function", "function": {"name": "a"}}] * 2, "two tools"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "nonsense"}}}], "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], r"'tools\[0\].function.parameters' must be object"),
    ([{"type": "function", "function": {"name": f"t{i}", "parameters": {"enum": ["x" * 1000] * 60}}}
      for i in range(5)], "over 256 KiB together"),
])
def test_malformed_tools_are_bad_requests(tools, says):
    with pytest.raises(ProtocolError, match=says):
        table(tools)


def test_grammars_and_schemas_are_bounded_before_anything_compiles_them():
    deep = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ProtocolError, match="nests deeper"):
        check_schema(deep)
    with pytest.raises(ProtocolError, match="over 64 KiB"):
        check_schema({"enum": ["x" * 1000] * 70})
    with pytest.raises(ProtocolError, match="nested 20000 deep"):
        gbnf_constraint("root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000, None)  # checked before any compile
    # parentheses in literals, classes and comments do not count
    assert nesting_depth('root ::= "(((" [(] "\\"(" # ((((\n' + "(" * 3 + '"a"' + ")" * 3) == 3


@pytest.fixture(scope="module")
def vocab_model():
    require_model(CHAT_MODEL_PATH)
    llama_cpp.llama_backend_init()
    params = _internals.LlamaModel.default_params()
    params.vocab_only = True
    model = _internals.LlamaModel(path_model=str(CHAT_MODEL_PATH), params=params, verbose=False)
    yield model
    model.close()


@pytest.fixture(scope="module")
def vocab(vocab_model):
    return vocabulary(vocab_model)


def _tokens(vocab: Vocabulary, text: str) -> list[int]:
    return vocab.tokenizer.tokenize_str(text, parse_special=True)


def _write(constraint: Constraint, vocab: Vocabulary, text: str) -> None:
    """Feed ``text`` to the constraint token by token, each one allowed."""
    for token in _tokens(vocab, text):
        assert constraint.allows(token), text
        constraint.accept(token)


@pytest.mark.model
def test_the_lazy_grammar_leaves_text_free_and_takes_over_at_the_opener(vocab):
    constraint = Constraint(vocab, triggers=triggers(TOOLS, vocab))
    _write(constraint, vocab, "I'll use a tool, maybe {\"x\": 1}.\n")
    assert not constraint.active
    constraint.accept(vocab.single_special("<tool_call>"))
    assert constraint.active
    forced = vocab.tokenizer.decode_str(constraint.forced())
    assert forced.startswith('\n{"name":')  # the grammar writes the call's frame itself
    _write(constraint, vocab, '\n{"name": "calculator", "arguments": {"')
    assert constraint.allows(_tokens(vocab, "expression")[0])
    assert not constraint.allows(_tokens(vocab, "path")[0])  # the calculator's schema has no such argument


@pytest.mark.model
def test_a_bare_call_at_the_start_is_constrained_from_its_first_token(vocab):
    constraint = Constraint(vocab, triggers=triggers(TOOLS, vocab))
    for token in _tokens(vocab, '{"name'):
        constraint.accept(token)
    assert not constraint.active
    constraint.accept(_tokens(vocab, '":')[0])
    assert constraint.active and constraint.gave_up is None
    constraint.accept(_tokens(vocab, ' "')[0])
    assert constraint.allows(_tokens(vocab, "calculator")[0]) and not constraint.allows(_tokens(vocab, "launch")[0])


@pytest.mark.model
def test_a_bare_call_in_doubled_braces_is_constrained_too(vocab):
    constraint = Constraint(vocab, triggers=triggers(TOOLS, vocab))
    _write(constraint, vocab, '{{"name": "')
    assert constraint.active and constraint.gave_up is None
    assert constraint.allows(_tokens(vocab, "calculator")[0]) and not constraint.allows(_tokens(vocab, "launch")[0])
    _write(constraint, vocab, 'calculator", "arguments": {"expression": "4"}}')
    assert not constraint.finished and constraint.allows(_tokens(vocab, "}")[0])  # the doubled brace closes it


@pytest.mark.model
def test_a_constraint_restricts_llama_cpp_candidates_and_logits_alike(vocab):
    constraint = Constraint(vocab, tagged_grammar(TOOLS, vocab))
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    array = _internals.LlamaTokenDataArray(n_vocab=vocab.n_vocab)
    array.copy_logits(logits)
    constraint.restrict(array.candidates)
    constraint.mask(logits)
    opener = vocab.single_special("<tool_call>")
    assert np.isfinite(logits).sum() == 1 and np.isfinite(logits[opener])  # only the opener may start the reply
    assert np.isfinite(array.candidates_data.logit).sum() == 1
    assert array.candidates_data.id[np.isfinite(array.candidates_data.logit)][0] == opener


@pytest.mark.model
def test_required_calls_and_a_finished_grammar_end_the_reply(vocab):
    constraint = Constraint(vocab, tagged_grammar({"calculator": TOOLS["calculator"]}, vocab, single=True))
    assert vocab.tokenizer.decode_str(constraint.forced()).startswith('<tool_call>\n{"name": "calculator"')
    for token in _tokens(vocab, f"<tool_call>\n{CALL}\n</tool_call>"):
        assert constraint.allows(token), vocab.tokenizer.dbg_tokens([token])
        constraint.accept(token)
    assert constraint.finished


def test_nested_optional_chains_are_flattened_outside_literals():
    assert _flatten_optional_chains('s ::= "\\"" (c (c (c)?)?)? "\\"" "(c)?" [(] # (c)?') == \
        's ::= "\\"" c{0,3} "\\"" "(c)?" [(] # (c)?'


@pytest.mark.model
def test_gbnf_takes_llguidance_when_it_can_and_llama_cpp_when_it_nests_deeper(vocab_model):
    assert isinstance(gbnf_constraint('root ::= "yes" | "no"', vocab_model), Constraint)
    # llama-cpp-python's JSON-schema converter nests one level per character of a string's maxLength.
    bounded = json_schema_to_gbnf(json.dumps({"type": "object", "properties": {
        "expression": {"type": "string", "maxLength": 300}}, "required": ["expression"]}))
    assert isinstance(gbnf_constraint(bounded, vocab_model), Constraint)
    deep = "root ::= " + "(" * 200 + '"a"' + ")?" * 200
    assert isinstance(gbnf_constraint(deep, vocab_model), LlamaGrammar)  # llama.cpp's own sampler takes it
    with pytest.raises(ProtocolError, match="does not parse"):
        gbnf_constraint("root ::= (", vocab_model)


def test_a_backtracking_pattern_is_matched_in_linear_time():
    """^(a+)+$ against a's and a '!' would take Python's re longer than the universe; RE2 answers at once."""
    tools = table([{"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "pattern": "^(a+)+$"}}}}}])
    text = '[{"name": "echo", "arguments": {"text": "' + "a" * 5000 + '!"}}]'
    t0 = time.perf_counter()
    [call] = scan(text, tools, final=True).calls
    assert time.perf_counter() - t0 < 0.5 and "does not match" in call.error


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(a)\\1"}}}, "properties.x.pattern"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "a(?=b)"}}}, "linear time"),
    ({"type": "object", "patternProperties": {"^a": {"type": "string"}}}, "patternProperties"),
])
def test_patterns_re2_cannot_run_are_refused_naming_the_field(schema, says):
    with pytest.raises(ProtocolError) as err:
        table([{"type": "function", "function": {"name": "t", "parameters": schema}}])
    assert err.value.code == "bad_request" and says in err.value.message


def test_a_property_named_pattern_is_not_a_pattern():
    tools = table([{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}}, "examples": [{"pattern": "(a)\\1"}]}}}])
    assert scan('{"name": "t", "arguments": {"pattern": "(x)\\\\1"}}', tools, final=True).calls[0].error is None
