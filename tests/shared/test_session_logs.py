"""Session ids are capabilities (whoever knows one reaches that session's KV), so logs carry
``shared.security.session_ref(id)``, the same short hash in every service, never the id (issue 34, finding 9:
they were logged in clear). The inference service's generation line is checked in tests/services/inference/test_caller_limits.py,
where a model runs."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from shared.client import Client
from tests.conftest import ServiceProcess, make_config, write_config


def logged_sessions(log: Path, event: str) -> set[str]:
    """The ``session`` values of a log's ``event`` lines."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return {line["session"] for line in lines if line.get("event") == event}


def test_tools_and_optimizer_log_a_sessions_ref_never_its_id(tmp_path):
    config = make_config(tmp_path)
    path = write_config(tmp_path, config)
    session = f"robot-{uuid.uuid4().hex}"
    services = []
    try:
        services = [ServiceProcess(name, path, config).start() for name in ("tools", "optimizer")]
        with Client(services[0].endpoint, timeout_s=30) as tools:
            assert tools.request("tool.call", {"tool": "calculator", "args": {"expression": "6*7"}},
                                 session)["output"] == "42"
        with Client(services[1].endpoint, timeout_s=30) as optimizer:
            optimizer.request("feedback", {"session_id": session, "success": True})
    finally:
        for svc in reversed(services):
            svc.stop()
    for svc in services:
        assert session not in svc.log.read_text(), svc.name
    # one session's lines still go together: the same ref in every service's log
    refs = logged_sessions(services[0].log, "tool_call") | logged_sessions(services[1].log, "feedback")
    assert len(refs) == 1 and len(refs.pop()) == 12
