"""The layers point down: shared <- services <- magnitude. And the healthcheck stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: What each layer may import from the project (its own layer included).
ALLOWED = {"shared": {"shared"}, "services": {"shared", "services"}, "magnitude": {"shared", "services", "magnitude"}}


def _project_imports(path: Path) -> set[str]:
    """Top-level project packages a module imports, wherever in the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & set(ALLOWED)
    return found


@pytest.mark.parametrize("layer", ["shared", "services"])
def test_lower_layers_never_import_upper_ones(layer):
    offenders = {str(p.relative_to(REPO)): sorted(bad)
                 for p in sorted((REPO / layer).rglob("*.py"))
                 if (bad := _project_imports(p) - ALLOWED[layer])}
    assert not offenders, f"{layer}/ imports a layer above it: {offenders}"


def test_the_check_itself_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from magnitude.agent import Agent\n")
    assert _project_imports(bad) == {"magnitude"}


def test_health_script_loads_no_model_runtime_and_no_user_package(tmp_path):
    """scripts/health is the compose healthcheck of every container, every 15 s: it must stay light."""
    env = {"PATH": "/usr/bin:/bin", "MAGNITUDE_HOME": str(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "health"), "--service", "inference", "--timeout", "0.2"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]  # nothing runs in this empty home: unhealthy, said plainly
    assert out.stdout.startswith("inference") and "UNHEALTHY" in out.stdout
    # -X importtime lines: "import time: self | cumulative | module"
    loaded = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "shared.protocol" in loaded and "zmq" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("llama_cpp", "magnitude", "services", "jinja2", "numpy")}
    assert not heavy, f"the healthcheck imported {sorted(heavy)}"
