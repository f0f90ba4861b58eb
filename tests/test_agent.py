"""The agent loop end to end on the real model, and the feedback API with its persistence."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from magnitude.agent import AsyncAgent, submit_feedback
from shared.client import Client, ServiceError
from tests.conftest import REPO, ServiceProcess, make_config, write_config


@pytest.fixture(scope="module")
def optimizer(run_home):
    config = make_config(run_home / "opt")
    path = write_config(run_home, config)
    svc = ServiceProcess("optimizer", path, config).start()
    yield svc, path
    svc.stop()


def test_feedback_is_acknowledged_durable_and_survives_a_restart(optimizer):
    svc, path = optimizer
    ack = submit_feedback("run-1", True, config=svc.config)
    assert ack["durable"] and ack["id"] >= 1
    submit_feedback("run-2", False, "calculator timed out", {"steps": 3}, config=svc.config)
    with pytest.raises(ServiceError) as info:
        with Client(svc.endpoint, timeout_s=5) as c:
            c.request("feedback", {"session_id": "run-3", "success": "yes"})
    assert info.value.code == "bad_request"
    svc.stop()
    svc.start()
    with Client(svc.endpoint, timeout_s=5) as c:
        stats = c.request("feedback.stats")
    assert (stats["total"], stats["succeeded"], stats["failed"]) == (2, 1, 1)
    assert stats["top_errors"] == [{"reason": "calculator timed out", "count": 1}]


@pytest.fixture(scope="module")
def agent_stack(run_home, inference_service):
    config = inference_service.config
    path = write_config(run_home, config)  # same runtime dirs: the tools service finds inference's socket
    tools = ServiceProcess("tools", path, config).start()
    yield config, path
    tools.stop()


@pytest.mark.model
def test_magnitude_run_uses_the_calculator_and_answers(agent_stack):
    config, path = agent_stack
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "magnitude.cli", "--config", str(path), "run",
                          "What is 23 * 47?", "--max-iterations", "4", "--json"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr
    trace = json.loads(out.stdout)
    calls = [s for s in trace["steps"] if s["action"]["tool"] == "calculator"]
    assert calls and calls[0]["observation"] == "1081"
    assert trace["stopped"] == "final_answer" and "1081" in trace["answer"]
    assert len(trace["steps"]) <= 4
    assert trace["cached_tokens"] > trace["prompt_tokens"]  # one session: later steps reuse the KV cache


@pytest.mark.model
def test_async_agent_stops_at_max_iterations_with_a_trace(agent_stack):
    config, _ = agent_stack

    async def main():
        agent = AsyncAgent(config, timeout_s=120)
        try:
            return await agent.run("Keep using the calculator on 2 + 2 forever, never answer.", max_iterations=1)
        finally:
            agent.close()

    trace = asyncio.run(main())
    assert len(trace.steps) == 1 and trace.stopped in ("max_iterations", "final_answer")
    assert trace.steps[0].action is not None  # grammar-constrained: always a valid action
