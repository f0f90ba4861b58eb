"""What the import contracts (pyproject.toml, scripts/lint) cannot say: every room holds what its users need, one
module owns each rule, the scheduler's thread only schedules, and the healthcheck stays light."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from shared.client import Client
from tests.conftest import REPO, ServiceProcess, make_config, require_model, write_config

#: The project's layers. Which may import which (and that services never import each other, the scheduler never
#: the service, no private module across packages, no cycles) are import-linter's contracts in pyproject.toml,
#: checked by scripts/lint; this file keeps what those contracts cannot say.
LAYERS = ("shared", "services", "magnitude")


def _imported_modules(path: Path) -> set[str]:
    """Dotted names a module imports, wherever in the file (functions included); ``from a import b`` gives
    both ``a`` and ``a.b`` (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_health_script_loads_no_model_runtime_and_no_user_package(tmp_path):
    """scripts/ops/health is the compose healthcheck of every container, every 15 s: it must stay light."""
    env = {"PATH": "/usr/bin:/bin", "MAGNITUDE_HOME": str(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "ops" / "health"), "--service", "inference", "--timeout", "0.2"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]  # nothing runs in this empty home: unhealthy, said plainly
    assert out.stdout.startswith("inference") and "UNHEALTHY" in out.stdout
    # -X importtime lines: "import time: self | cumulative | module"
    loaded = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "shared.protocol" in loaded and "zmq" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("llama_cpp", "magnitude", "services", "jinja2", "numpy")}
    assert not heavy, f"the healthcheck imported {sorted(heavy)}"


# --- every room holds what its users need -------------------------------------------------------------
def _package(path: Path) -> str:
    """The package a product module belongs to: ``shared``, ``magnitude`` or ``services.<name>``."""
    parts = path.relative_to(REPO).parts
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 2 else parts[0]


def _shared_units() -> dict[str, Path]:
    """The modules under shared/, a subpackage (shared/config, shared/service) counting as one."""
    units = {}
    for path in sorted((REPO / "shared").iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            units[f"shared.{path.stem}"] = path
        elif (path / "__init__.py").is_file():
            units[f"shared.{path.name}"] = path
    return units


def test_every_shared_module_is_imported_by_two_packages():
    """shared/ is for what is shared: a module only one package uses belongs in that package."""
    users: dict[str, set[str]] = {unit: set() for unit in _shared_units()}
    for path in sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py")):
        importer = _package(path)
        for name in _imported_modules(path):
            for unit, where in _shared_units().items():
                inside = where.is_dir() and where in path.parents or path == where
                if not inside and (name == unit or name.startswith(unit + ".")):
                    users[unit].add(importer)
    lonely = {unit: sorted(packages) for unit, packages in users.items() if len(packages) < 2}
    assert not lonely, f"shared/ modules used by fewer than two packages (move them to their user): {lonely}"


# --- one module owns each request rule ------------------------------------------------------------------
#: Keyword arguments that state a bound (pydantic's Field, the protocol's field declarations).
_BOUND_KEYWORDS = {"le", "ge", "lt", "gt", "max_length", "min_length", "max_len", "min", "max"}


def _number(node: ast.AST) -> float | None:
    """The value of a numeric literal or of constant arithmetic on literals (1 << 20), else None."""
    if not all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
               for n in ast.walk(node)):
        return None
    try:
        value = eval(compile(ast.Expression(node), "<bound>", "eval"))  # literals and operators only
    except Exception:
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bound_literals(path: Path) -> list[str]:
    """Numeric literals other than 0 and 1 written as a bound: a Field(le=..)-style keyword."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        values = [k.value for k in node.keywords if k.arg in _BOUND_KEYWORDS]
        found += [f"{path}:{v.lineno}" for v in values if _number(v) not in (None, 0, 1)]
    return found


def test_no_request_bound_is_written_outside_the_protocol_module():
    """A request bound (max_tokens, names, ids, sizes) is a constant of shared/protocol.py that every check imports,
    so the gateway and the services cannot disagree."""
    offenders = [hit for layer in ("services", "magnitude") for p in sorted((REPO / layer).rglob("*.py"))
                 for hit in _bound_literals(p)]
    assert not offenders, f"request bounds written as literals (import them from shared.protocol): {offenders}"


def test_the_bound_check_itself_sees_a_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from pydantic import Field\nx = Field(None, max_length=1 << 16)\ny = Field(ge=2, le=4096)\n"
                   "ok = Field(None, ge=0, le=MAX_TOKENS)\n")
    assert [hit.rsplit(":", 1)[1] for hit in _bound_literals(bad)] == ["2", "3", "3"]


# --- the scheduler only schedules -----------------------------------------------------------------------
@pytest.mark.model
def test_the_scheduler_thread_never_runs_service_code(tmp_path, monkeypatch):
    """Every function the scheduler's thread runs while it serves generations (streamed, cancelled), a control
    message and the session messages: none is in services/inference/service.py. Its replies go through the
    prepared request's outlet, its engine work through control.py."""
    require_model()
    config = make_config(tmp_path, n_ctx=512)
    trace = tmp_path / "trace.json"
    monkeypatch.setenv("TRACE_OUT", str(trace))
    inference = ServiceProcess("inference", write_config(tmp_path, config), config,
                               module="tests.traced_inference").start()
    try:
        with Client.for_service("inference", config, timeout_s=60) as client:
            pieces = list(client.generate_stream("The robot drove to the", "s1", max_tokens=8, temperature=0))
            assert pieces[-1].stats.completion_tokens == 8
            stream = client.generate_stream("Once upon a time", "s2", max_tokens=200, temperature=0)
            next(stream)
            stream.close()  # cancels it, mid-generation
            assert client.request("engine.configure", {"settings": {"spec_draft_tokens": 0}})["settings"]
            assert client.request("sessions", session_id="s1") is not None
            assert client.request("session.drop", session_id="s1")["dropped"]
            assert client.request("model.list")["default"]
    finally:
        inference.stop()
    ran = {tuple(pair) for pair in json.loads(trace.read_text())}
    files = {Path(f).resolve() for f, _ in ran}
    assert (REPO / "services/inference/scheduler.py").resolve() in files  # the trace saw the scheduler's work
    assert (REPO / "services/inference/control.py").resolve() in files
    service_code = sorted(name for f, name in ran if Path(f).resolve() == (REPO / "services/inference/service.py"))
    assert not service_code, f"the scheduler's thread ran service.py's {service_code}"
