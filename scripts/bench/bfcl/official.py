"""BFCL's own code and data, from the unpacked ``bfcl-eval`` wheel (scripts/provision/bfcl.py): the base set's
cases and ground truth, the function docs as OpenAI tool specs, the simulated APIs' executor and the official
multi-turn checker. Nothing here comes from Magnitude (an import contract keeps it so): the score cannot agree
with the system under test by construction.

What the wheel's multi-turn code imports is the standard library, its own modules and ``mpmath`` (``MathAPI.
logarithm`` only). Without mpmath installed, ``_mpmath_stub`` stands in: ``mp.dps`` and ``log`` over
``decimal`` at that many digits, printed as mpmath prints (``mpf('…')``). The model's calls and the ground
truth's both run on it, so the checker compares like with like; only a logarithm's last digits could read
differently from real mpmath's.
"""

from __future__ import annotations

import copy
import decimal
import importlib
import json
import sys
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORY = "multi_turn_base"
DATA_FILE = f"BFCL_v4_{CATEGORY}.json"
#: BFCL's type names (Python's and Java's among them) as JSON schema types, as bfcl_eval.constants.type_mappings'
#: GORILLA_TO_OPENAPI maps them (checked against it in tests/scripts/test_bench_bfcl.py).
JSON_TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string",
              "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
              "object": "object", "tuple": "array", "any": "string", "byte": "integer", "short": "integer",
              "long": "integer", "double": "number", "char": "string", "ArrayList": "array", "Array": "array",
              "HashMap": "object", "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string",
              "String": "string", "Bigint": "integer"}


# --- the wheel's modules ------------------------------------------------------------------------------
class _Mpf(decimal.Decimal):
    def __repr__(self) -> str:
        text = str(self)
        return f"mpf('{text if '.' in text or 'E' in text else text + '.0'}')"  # mpmath writes 2 as mpf('2.0')

    def __truediv__(self, other: Any) -> _Mpf:
        return _Mpf(decimal.Decimal.__truediv__(self, other))


def _mpmath_stub() -> types.ModuleType:
    """The one piece of mpmath the multi-turn APIs use: ``mp.dps = n`` then ``log(x)`` (``MathAPI.logarithm``)."""
    module = types.ModuleType("mpmath")
    module.mp = types.SimpleNamespace(dps=15)  # type: ignore[attr-defined]

    def log(x: Any) -> _Mpf:
        decimal.getcontext().prec = max(int(module.mp.dps), 1)  # type: ignore[attr-defined]
        return _Mpf(decimal.Decimal(str(x)).ln())

    module.log = log  # type: ignore[attr-defined]
    module.__doc__ = "scripts/bench/bfcl/official.py's stand-in for mpmath (mp.dps and log only)"
    return module


def load_wheel(root: Path) -> None:
    """Put the unpacked wheel on ``sys.path`` (idempotent) and mpmath's stand-in in place if mpmath is absent."""
    if not (root / "bfcl_eval").is_dir():
        raise FileNotFoundError(f"no bfcl_eval package under {root}: run python -m scripts.provision.bfcl")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        importlib.import_module("mpmath")
    except ImportError:
        sys.modules["mpmath"] = _mpmath_stub()


def _utils() -> Any:
    return importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils")


def _checker() -> Any:
    return importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")


def wheel_type_map() -> dict[str, str]:
    return dict(importlib.import_module("bfcl_eval.constants.type_mappings").GORILLA_TO_OPENAPI)


# --- cases --------------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    turns: list[list[dict]]  # per turn, its messages (the base set: one user message each)
    initial_config: dict
    involved_classes: list[str]
    functions: list[dict]  # BFCL function docs of the involved classes, as the official runner gives them
    ground_truth: list[list[str]]  # per turn, the calls that solve it, as Python call strings

    @property
    def entry(self) -> dict:
        """The test entry as the official checker reads it."""
        return {"id": self.id, "question": self.turns, "initial_config": self.initial_config,
                "involved_classes": self.involved_classes, "function": self.functions}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_cases(root: Path, limit: int | None = None) -> list[Case]:
    """The base set's cases in file order (the first ``limit``), each with its function docs (every function of
    its involved classes, as bfcl_eval.utils.populate_test_cases_with_predefined_functions gives them) and
    ground truth."""
    load_wheel(root)
    data = root / "bfcl_eval" / "data"
    backend = importlib.import_module("bfcl_eval.constants.executable_backend_config")
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(data / "possible_answer" / DATA_FILE)}
    docs: dict[str, list[dict]] = {}
    cases = []
    for entry in _jsonl(data / DATA_FILE)[:limit]:
        functions = []
        for cls in entry["involved_classes"]:
            if cls not in docs:
                docs[cls] = _jsonl(data / "multi_turn_func_doc" / backend.MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])
            functions += copy.deepcopy(docs[cls])
        cases.append(Case(entry["id"], entry["question"], entry["initial_config"], entry["involved_classes"],
                          functions, answers[entry["id"]]))
    return cases


# --- function docs as tool specs ------------------------------------------------------------------------
def json_schema(doc: dict) -> dict:
    """One BFCL parameter schema (``dict``, ``float``, ``tuple`` ... at any depth) as JSON schema: every type
    name mapped (an unknown or missing one is a string, as BFCL's own conversion has it), nested
    ``properties`` and ``items`` converted too; descriptions, enums, defaults and required lists kept."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "type":
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = json_schema(value)
        else:
            out[key] = copy.deepcopy(value)
    out["type"] = JSON_TYPES.get(doc.get("type", "string"), "string")
    return out


def tool_spec(function: dict) -> dict:
    """A BFCL function doc as a chat-completions tool (``response``, the doc of what it returns, is left out:
    BFCL's own OpenAI handler leaves it out too)."""
    parameters = json_schema(function.get("parameters") or {"type": "dict", "properties": {}})
    parameters["type"] = "object"
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": function["name"], "description": function["description"],
                                             "parameters": parameters}}


def response_tool(spec: dict) -> dict:
    """The same tool in the Responses API's flat shape."""
    return {"type": "function", **spec["function"]}


# --- executing calls ------------------------------------------------------------------------------------
def call_string(name: str, arguments: dict) -> str:
    """A tool call as the Python call the official executor evaluates: bfcl_eval.model_handler.utils.
    convert_to_function_call's format, ``name(k=repr(v),...)``."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


class Session:
    """One case's simulated APIs for one system: the official executor (``execute_multi_turn_func_call``) runs
    each call on the instances it keeps for this (system, case), as BFCL's inference does."""

    def __init__(self, case: Case, system: str):
        self.case = case
        self.model_name = f"magnitude_{system}_{uuid.uuid4().hex[:12]}"
        self.functions = {f["name"] for f in case.functions}

    def run(self, name: str, arguments: Any) -> tuple[str | None, str]:
        """Run one tool call: (its call string, or None when it was not run, and the output for the model). A
        name that is not one of the case's functions, or arguments that are not an object of identifiers, is
        not run (the executor ``eval``s the call string) and not recorded."""
        if name not in self.functions:
            return None, f"Error during execution: no function {name!r} here"
        if not isinstance(arguments, dict) or not all(isinstance(k, str) and k.isidentifier() for k in arguments):
            return None, "Error during execution: the arguments must be a JSON object of named parameters"
        call = call_string(name, arguments)
        return call, self.execute(call)

    def execute(self, call: str) -> str:
        results, _ = _utils().execute_multi_turn_func_call(
            [call], self.case.initial_config, self.case.involved_classes, self.model_name, self.case.id,
            long_context=False, is_evaL_run=False)
        return results[0]

    def close(self) -> None:
        forget(self.model_name)


def forget(model_name: str) -> None:
    """Drop the API instances the official executor keeps in its module's globals for ``model_name``."""
    names = _utils().__dict__
    for key in [k for k in names if k.startswith(model_name)]:
        del names[key]


def turns_passed(case: Case, calls: list[list[list[str]]]) -> int:
    """How many of the case's turns, from the first, the official checker passes (it stops at the first turn
    that fails): the checker run on each prefix of the turns, a finer figure than the case's verdict."""
    for k in range(1, len(case.ground_truth) + 1):
        if len(calls) < k:
            return k - 1
        name = f"magnitude_check_{uuid.uuid4().hex[:12]}"
        try:
            verdict = _checker().multi_turn_checker([[step for step in turn if step] for turn in calls[:k]],
                                                    case.ground_truth[:k], case.entry, CATEGORY, name)
        finally:
            forget(name)
        if not verdict["valid"]:
            return k - 1
    return len(case.ground_truth)


def check(case: Case, calls: list[list[list[str]]]) -> dict:
    """The official verdict on a case: ``calls`` per turn, per model step, the calls it made (as call strings);
    bfcl_eval's multi_turn_checker replays them and the ground truth on fresh instances and compares the state
    after each turn and the outputs. A run of fewer turns than the case fails, as the official runner's
    force-terminated check has it. Returns the checker's dict (``valid``, else ``error_type``, ...)."""
    if len(calls) != len(case.ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"{len(calls)} turns run of {len(case.ground_truth)}"}
    # the official runner drops steps that decode to nothing before it checks
    decoded = [[step for step in turn if step] for turn in calls]
    name = f"magnitude_check_{uuid.uuid4().hex[:12]}"
    try:
        return dict(_checker().multi_turn_checker(decoded, case.ground_truth, case.entry, CATEGORY, name))
    finally:
        forget(name)
