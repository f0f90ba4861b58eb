"""`docker stack deploy` for real: the stack `magnitude fleet stack` makes from compose.yaml, on a one-node Swarm.

The node is labelled a robot's box, the gateway's API key is a Swarm secret, and the image is the one the compose
test builds offline (Swarm runs it from the node's own images: ``--resolve-image never``). Every service comes up
healthy by its Docker healthcheck; a chat goes through the gateway's port, published on the node; a body over the
inline limit crosses to inference through the node's shared /dev/shm volume; an inference task stopped by the test
is replaced by Swarm and its replacement answers the session from the KV saved at the stop (the same answer,
the saved tokens reused); a SIGSTOPped inference task is ended by the watchdog's swarm backend and replaced by
Swarm; ``docker stack rm`` leaves nothing running. Then the split stack (``--inference-node``, both sides placed
on this one node): the robots' services reach inference and the optimizer over tcp with CURVE, the keys being
Swarm secrets, and a session's KV stays with inference. Timings are printed in the test summary.

Needs what the compose test needs (tests/system/conftest.py) and an engine that may enter Swarm mode: the test
initialises a one-node swarm when the engine is in none, and leaves it again afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from magnitude.fleet.stack import API_KEYS_SECRET, CLIENT_SECRETS, CURVE_CLIENT, ROLE_LABEL, SERVER_SECRETS
from services.gateway.keys import create_key
from shared import shm
from shared.client import Client
from shared.config import SERVICE_NAMES, WATCHDOG_NAME
from shared.security import create_keys
from tests.conftest import REPO, REPORT
from tests.system.conftest import IMAGE, run

pytestmark = [pytest.mark.docker, pytest.mark.model]

STACK = "mag-e2e"
SERVICES = (*SERVICE_NAMES, WATCHDOG_NAME)
GATEWAY = "http://127.0.0.1:8000/v1"
HEALTHY_WITHIN_S = 300  # the setup jobs assemble the models first; inference's start_period is 60 s


def poll(predicate, timeout_s: float, what: str):
    """``predicate()`` every 2 s until it is truthy (each try runs docker commands), else fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(2)
    raise AssertionError(f"not within {timeout_s:g}s: {what}")


def containers(service: str | None = None, running_only: bool = True, stack: str = STACK) -> list[dict]:
    """`docker inspect` of the stack's containers (of one service)."""
    label = f"com.docker.swarm.service.name={stack}_{service}" if service else f"com.docker.stack.namespace={stack}"
    ids = run("docker", "ps", "-q", *([] if running_only else ["-a"]), "--filter", f"label={label}").stdout.split()
    return json.loads(run("docker", "inspect", *ids).stdout) if ids else []


def health_states(stack: str = STACK) -> dict[str, str]:
    return {c["Config"]["Labels"]["com.docker.swarm.service.name"].removeprefix(f"{stack}_"):
            c["State"].get("Health", {}).get("Status", "none") for c in containers(stack=stack)}


def all_healthy(stack: str = STACK) -> bool:
    states = health_states(stack)
    return all(states.get(name) == "healthy" for name in SERVICES)


def host_client(service: str) -> Client:
    run_dir = run("docker", "volume", "inspect", "-f", "{{.Mountpoint}}", f"{STACK}_run").stdout.strip()
    return Client(f"ipc://{run_dir}/{service}.sock", timeout_s=10)


def remove_stack(stack: str = STACK, secrets: tuple[str, ...] = (API_KEYS_SECRET,)) -> None:
    """The stack, its exited job containers, volumes and secrets: what an earlier run or this one left."""
    run("docker", "stack", "rm", stack, check=False)
    poll(lambda: not containers(stack=stack), 120, "the stack's containers gone")
    leftovers = run("docker", "ps", "-aq", "--filter", f"label=com.docker.stack.namespace={stack}").stdout.split()
    if leftovers:
        run("docker", "rm", "-f", *leftovers, check=False)
    for volume in ("run", "models", "data", "shm"):  # a volume is freed a moment after its last container
        poll(lambda: run("docker", "volume", "rm", "-f", f"{stack}_{volume}", check=False).returncode == 0, 60,
             f"volume {stack}_{volume} removed")
    for secret in secrets:
        run("docker", "secret", "rm", secret, check=False)


def deploy(stack_file: Path, stack: str) -> float:
    """``docker stack deploy`` until every service is healthy by its docker healthcheck; the seconds it took."""
    start = time.monotonic()
    run("docker", "stack", "deploy", "--resolve-image", "never", "-c", str(stack_file), stack,
        MAGNITUDE_IMAGE=IMAGE, MAGNITUDE_WHEELHOUSE=str(REPO / "wheelhouse"))
    try:
        poll(lambda: all_healthy(stack), HEALTHY_WITHIN_S, "every service healthy by its docker healthcheck")
    except AssertionError:
        logs = {name: run("docker", "service", "logs", "--tail", "5", f"{stack}_{name}", check=False).stdout[-800:]
                for name in SERVICES}
        raise AssertionError(f"not all healthy: {health_states(stack)}\n{logs}") from None
    return time.monotonic() - start


@pytest.fixture(scope="module")
def swarm(image):
    joined = run("docker", "info", "-f", "{{.Swarm.LocalNodeState}}").stdout.strip() == "active"
    if not joined:
        run("docker", "swarm", "init", "--advertise-addr", "127.0.0.1")
    node = run("docker", "info", "-f", "{{.Swarm.NodeID}}").stdout.strip()
    run("docker", "node", "update", "--label-add", f"{ROLE_LABEL}=robot", node)
    try:
        yield node
    finally:
        if not joined:
            run("docker", "swarm", "leave", "--force", check=False)


@pytest.fixture(scope="module")
def stack(swarm, tmp_path_factory):
    out = tmp_path_factory.mktemp("swarm")
    remove_stack()
    run(sys.executable, "-m", "magnitude.cli", "fleet", "stack", "--out", str(out), PYTHONPATH=str(REPO))
    key = create_key(out / "api_keys", "e2e")
    run("docker", "secret", "create", API_KEYS_SECRET, str(out / "api_keys"))
    try:
        took = deploy(out / "stack.yaml", STACK)
        REPORT.append(f"swarm e2e: `docker stack deploy` to every service healthy: {took:.0f} s "
                      "(models assembled by the setup jobs)")
        yield key
    finally:
        remove_stack()


def test_every_service_is_healthy_and_the_setup_jobs_ran_once_on_the_node(stack):
    assert all_healthy(), health_states()
    for job in ("setup", "setup-embedding"):
        states = run("docker", "service", "ps", "--format", "{{.CurrentState}}", f"{STACK}_{job}").stdout.split("\n")
        assert [s for s in states if s.startswith("Complete")], (job, states)
    with host_client(WATCHDOG_NAME) as client:
        assert client.request("watchdog.status")["backend"] == "swarm"
    with host_client("tools") as client:  # no seccomp profile under Swarm: bwrap cannot run, and nothing needs it
        assert client.health()["tool_isolation"]["isolation"] == "rlimits"


def test_chat_through_the_port_published_on_the_node(stack):
    from openai import AuthenticationError, OpenAI
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=GATEWAY, api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=GATEWAY, api_key=stack, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="default", max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in one word."}])
    assert "paris" in reply.choices[0].message.content.lower(), reply


def test_a_body_over_the_inline_limit_crosses_to_inference_through_the_nodes_shared_memory(stack):
    """The gateway hands inference a chat over the limit in a /dev/shm segment: it arrives whole only where the
    two containers share that volume (inference then counts its tokens and refuses it for the context)."""
    from openai import BadRequestError, OpenAI
    words = shm.INLINE_LIMIT_BYTES // 5 + 1000
    client = OpenAI(base_url=GATEWAY, api_key=stack, max_retries=0, timeout=300)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="default", max_tokens=4, messages=[
            {"role": "user", "content": "word " * words}])
    assert "n_ctx is" in str(refused.value), refused.value


#: Questions with one sure answer each, for the tests that compare a session's answer with a cold request's: the
#: session's KV was built in other batch shapes than the cold prefill, and an open question ("name two planets")
#: sits on near ties that llama.cpp's numerics flip (docs/scheduler.md, "Same text in mixed batches").
CAPITALS = [f"What is the capital of {country}? Answer with the city's name only."
            for country in ("France", "Japan", "Italy", "Egypt")]


def _chat(key: str, messages: list[dict], session: str | None = None):
    from openai import OpenAI
    client = OpenAI(base_url=GATEWAY, api_key=key, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=messages,
                                           extra_headers={"X-Session-Id": session} if session else None)
    return reply.choices[0].message.content, reply.usage


def test_a_replaced_inference_task_answers_the_session_from_its_saved_kv(stack):
    first = [{"role": "user", "content": CAPITALS[2]}]
    answer, usage = _chat(stack, first, "swarm-e2e")
    [before] = containers("inference")
    run("docker", "kill", "--signal", "TERM", before["Id"])  # drains and saves the sessions, then exits 0
    stopped_at = time.monotonic()
    poll(lambda: [c["Id"] for c in containers("inference")] not in ([], [before["Id"]]), 120,
         "Swarm starts a new inference task")
    poll(all_healthy, HEALTHY_WITHIN_S, "the new inference task healthy")
    replaced_s = time.monotonic() - stopped_at
    follow_up = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": CAPITALS[3]}]
    resumed, resumed_usage = _chat(stack, follow_up, "swarm-e2e")  # the new process's first request
    cold, _ = _chat(stack, follow_up)
    assert resumed == cold, (resumed, cold)
    saved = usage.prompt_tokens + usage.completion_tokens
    assert resumed_usage.prompt_tokens_details.cached_tokens >= saved - 1, (resumed_usage, saved)
    REPORT.append(f"swarm e2e: inference task stopped, replaced by Swarm and healthy in {replaced_s:.0f} s; the "
                  f"session resumed with {resumed_usage.prompt_tokens_details.cached_tokens} of "
                  f"{resumed_usage.prompt_tokens} prompt tokens from its saved KV")


def fleet(*args: str) -> str:
    return run(sys.executable, "-m", "magnitude.cli", "fleet", *args, "--stack", STACK, timeout=300,
               PYTHONPATH=str(REPO)).stdout


def test_fleet_status_lists_every_service_of_every_node_with_its_health(stack, swarm):
    status = json.loads(fleet("status", "--json"))
    hostname = run("docker", "info", "-f", "{{.Name}}").stdout.strip()
    node = status["nodes"][hostname]
    assert node["role"] == "robot" and node["state"] == "ready", node
    assert set(node["services"]) == set(SERVICES), node["services"]
    for name, service in node["services"].items():
        assert service["task"] == "running" and service["healthy"] is True, (name, service)
    assert node["services"]["inference"]["model"], node["services"]["inference"]
    assert node["decode_tps"] and node["decode_tps"] > 0, node  # the chats above, as the optimizer saw them


def test_fleet_strategy_dump_then_restore_to_the_node(stack, tmp_path):
    hostname = run("docker", "info", "-f", "{{.Name}}").stdout.strip()
    fleet("strategy", "dump", "--out", str(tmp_path))
    dumped = json.loads((tmp_path / f"{hostname}.json").read_text())
    assert dumped["format"] == "magnitude-strategy", dumped
    restored = fleet("strategy", "restore", str(tmp_path / f"{hostname}.json"), "--node", hostname)
    assert f"{hostname}" in restored and json.dumps(dumped["settings"]) in restored, restored
    poll(lambda: not run("docker", "ps", "-aq", "--filter", f"name={STACK}_probe-").stdout.split(), 60,
         "the probes' containers removed with their services (they would hold the run volume)")


def test_the_watchdog_ends_a_sigstopped_inference_task_and_swarm_replaces_it(stack):
    [before] = containers("inference")
    service_pid = psutil.Process(before["State"]["Pid"]).children()[0].pid  # init (pid 1) -> python
    os.kill(service_pid, signal.SIGSTOP)  # alive, but answers nothing: hung
    stopped_at = time.monotonic()
    try:
        poll(lambda: [c["Id"] for c in containers("inference")] not in ([], [before["Id"]]), 120,
             "the watchdog ends the hung task and Swarm starts a new one")
        replaced_s = time.monotonic() - stopped_at
    finally:
        if psutil.pid_exists(service_pid):
            os.kill(service_pid, signal.SIGCONT)
    assert not psutil.pid_exists(service_pid)
    poll(all_healthy, HEALTHY_WITHIN_S, "inference healthy again")
    with host_client(WATCHDOG_NAME) as client:
        status = client.request("watchdog.status")
    assert status["services"]["inference"]["last_reason"] == "hung", status
    REPORT.append(f"swarm e2e: SIGSTOPped inference ended as hung by the watchdog's swarm backend and replaced by "
                  f"Swarm after {replaced_s:.0f} s")


def test_stack_rm_leaves_nothing_running(stack):
    run("docker", "stack", "rm", STACK)
    poll(lambda: not containers(), 120, "no container of the stack running")
    assert run("docker", "service", "ls", "-q", "--filter", f"label=com.docker.stack.namespace={STACK}").stdout == ""



# --- the split stack: inference on its own node, the robots' services reach it over tcp with CURVE -------------
SPLIT = "mag-split-e2e"


@pytest.fixture(scope="module")
def split_stack(stack, tmp_path_factory):
    """Deployed once the first stack is gone, with its API key. One node plays both roles here: each side's
    placement is the manager (a real split labels two nodes)."""
    out = tmp_path_factory.mktemp("split")
    run("docker", "stack", "rm", STACK, check=False)  # its gateway holds the node's port 8000
    poll(lambda: not containers(), 120, "the first stack's containers gone")
    keys = out / "keys"
    create_keys(keys, [CURVE_CLIENT])
    curve = (*CLIENT_SECRETS, *SERVER_SECRETS)
    remove_stack(SPLIT, curve)
    for secret, path in {**CLIENT_SECRETS, **SERVER_SECRETS}.items():
        run("docker", "secret", "create", secret, str(keys / path))
    run(sys.executable, "-m", "magnitude.cli", "fleet", "stack", "--out", str(out), "--inference-node",
        "--robot-constraint", "node.role == manager", "--inference-constraint", "node.role == manager",
        PYTHONPATH=str(REPO))
    try:
        took = deploy(out / "stack.yaml", SPLIT)
        REPORT.append(f"swarm e2e: the split stack (inference and the optimizer reached over tcp + CURVE, keys as "
                      f"Swarm secrets) to every service healthy: {took:.0f} s")
        yield stack
    finally:
        remove_stack(SPLIT, curve)


def test_split_a_robot_chats_with_inference_over_tcp_with_curve_and_its_session_stays_there(split_stack):
    """The gateway (robot side) reaches inference by its service name over tcp with the fleet's client key; the
    session's KV stays with inference, so the second turn reuses it, and answers as a cold request does."""
    assert "tcp://" in run("docker", "exec", containers("gateway", stack=SPLIT)[0]["Id"], "cat",
                           "/etc/magnitude/magnitude.yaml").stdout
    first = [{"role": "user", "content": CAPITALS[0]}]
    answer, _ = _chat(split_stack, first, "split-e2e")
    follow_up = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": CAPITALS[1]}]
    warm, warm_usage = _chat(split_stack, follow_up, "split-e2e")
    cold, _ = _chat(split_stack, follow_up)
    assert warm == cold and warm_usage.prompt_tokens_details.cached_tokens > 0, (warm, cold, warm_usage)


def test_split_fleet_status_shows_each_side_with_its_health(split_stack):
    status = json.loads(run(sys.executable, "-m", "magnitude.cli", "fleet", "status", "--json", "--stack", SPLIT,
                            timeout=300, PYTHONPATH=str(REPO)).stdout)
    [node] = status["nodes"].values()
    assert set(node["services"]) == set(SERVICES), node["services"]
    unhealthy = {name: svc for name, svc in node["services"].items() if svc["healthy"] is not True}
    assert not unhealthy, unhealthy
