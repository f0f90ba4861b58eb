"""examples/robot_agent.py against the real stack, with the chat (inference) service killed mid-stream.

Inference, tools and optimizer run as real processes. When the first planning tokens appear the
test SIGKILLs inference and starts it again a moment later (a watchdog's job in production). The
example must finish every task, exit 0, say that it retried, and leave one feedback row per task.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from shared.client import Client
from shared.config import parse_config
from tests.conftest import REPO, REPORT, ServiceProcess, make_config, write_config

pytestmark = pytest.mark.model

TASKS = ["The robot carries 3 boxes of 14 kg each. How many kg is that in total?",
         "A shelf has 6 rows of 8 cans. How many cans is that?"]


class Output:
    """Collects a process's output in a thread, so the test can wait for a marker while it runs."""

    def __init__(self, proc: subprocess.Popen):
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        while chunk := proc.stdout.read1(256):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, predicate, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.text):
            assert time.monotonic() < deadline, f"timed out; output so far:\n{self.text}"
            time.sleep(0.02)


def plan_tokens_arrived(text: str) -> bool:
    return "plan> 1." in text and len(text.split("plan> 1.", 1)[1].strip()) > 0


def test_robot_example_survives_a_chat_service_restart(tmp_path_factory):
    from shared import catalog
    model = catalog.get(catalog.TEST_CHAT_MODEL).path()  # the agent chats: a model with a chat template
    if not model.is_file():
        pytest.fail(f"{model} missing; run `magnitude models pull {catalog.TEST_CHAT_MODEL}`")
    home = tmp_path_factory.mktemp("robot")
    base = make_config(home, model_path=str(model))
    config = parse_config({**base.model_dump(mode="json"), "agent": {"max_step_tokens": 48}})
    path = write_config(home, config)
    services, robot = {}, None
    try:
        for name in ("inference", "tools", "optimizer"):
            services[name] = ServiceProcess(name, path, config).start()
        cmd = [sys.executable, "-u", str(REPO / "examples" / "robot_agent.py"), "--config", str(path),
               "--plan-tokens", "32", "--max-iterations", "2", "--deadline", "60"]
        for task in TASKS:
            cmd += ["--task", task]
        robot = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=str(REPO)))
        output = Output(robot)
        output.wait_for(plan_tokens_arrived, 60)
        started = time.monotonic()
        services["inference"].proc.kill()  # SIGKILL during the first streamed plan
        output.wait_for(lambda text: "[stream restarted" in text, 10)  # fail fast, not at the 120 s timeout
        noticed_s = time.monotonic() - started
        time.sleep(1.5)
        services["inference"].start()
        assert robot.wait(120) == 0, output.text
        REPORT.append(f"robot example: inference SIGKILLed mid-stream, noticed in {noticed_s:.2f}s, "
                      f"all {len(TASKS)} tasks done {time.monotonic() - started:.1f}s after the kill")
        output.thread.join(5)  # the rest of the output, up to EOF
        text = output.text
        assert "[stream restarted: unavailable]" in text, text  # told to discard the partial plan
        assert '"event": "retrying"' in text and '"code": "unavailable"' in text, text
        assert text.count("done> ") == len(TASKS) and '"event": "all_tasks_done"' in text, text
        with Client(services["optimizer"].endpoint, timeout_s=10) as client:
            stats = client.request("feedback.stats")
        assert stats["total"] == len(TASKS)
    finally:
        if robot is not None and robot.poll() is None:
            robot.kill()
        for svc in services.values():
            svc.stop()
