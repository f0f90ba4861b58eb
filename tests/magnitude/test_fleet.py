"""``magnitude fleet stack``: the Swarm stack made from compose.yaml (the deploy itself: tests/system/test_swarm_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from magnitude.fleet.stack import API_KEYS_SECRET, ROLE_LABEL, SWARM_DROPS, write_stack
from tests.conftest import REPO


def test_the_generated_stack_says_the_swarm_way_what_swarm_refuses_or_ignores(tmp_path):
    stack = yaml.safe_load(write_stack(REPO / "compose.yaml", REPO / "docker" / "magnitude.yaml", tmp_path)
                           .read_text())
    assert set(stack["services"]) == set(yaml.safe_load((REPO / "compose.yaml").read_text())["services"])
    for name, service in stack["services"].items():
        assert not set(SWARM_DROPS) & set(service), name
        assert service["deploy"]["placement"]["constraints"] == [f"node.labels.{ROLE_LABEL} == robot"], name
    assert stack["services"]["inference"]["deploy"]["resources"]["limits"] == {"memory": "2g", "cpus": "2.0"}
    assert stack["services"]["inference"]["deploy"]["mode"] == "global"
    assert stack["services"]["setup"]["deploy"]["mode"] == "global-job"
    assert f"${{MAGNITUDE_WHEELHOUSE:-{REPO}/wheelhouse}}:/wheelhouse:ro" in stack["services"]["setup"]["volumes"]
    shared_memory = {"type": "volume", "source": "shm", "target": "/dev/shm", "volume": {"nocopy": True}}
    assert shared_memory in stack["services"]["gateway"]["volumes"]
    assert shared_memory not in stack["services"]["setup"]["volumes"]
    assert stack["volumes"]["shm"]["driver_opts"]["type"] == "tmpfs"
    assert stack["services"]["gateway"]["ports"] == [{"target": 8000, "published": 8000, "protocol": "tcp",
                                                      "mode": "host"}]
    assert stack["services"]["gateway"]["secrets"][0]["source"] == API_KEYS_SECRET
    assert stack["services"]["watchdog"]["environment"]["MAGNITUDE_WATCHDOG_BACKEND"] == "swarm"
    config = yaml.safe_load((tmp_path / "magnitude.yaml").read_text())
    assert config["gateway"]["api_keys_file"] == f"/run/secrets/{API_KEYS_SECRET}"
    assert config["agent"] == yaml.safe_load((REPO / "docker" / "magnitude.yaml").read_text())["agent"]
    assert Path(stack["configs"]["magnitude_config"]["file"]) == tmp_path / "magnitude.yaml"


def test_the_split_stack_puts_inference_beside_its_optimizer_and_gives_each_side_its_endpoints_and_keys(tmp_path):
    from magnitude.fleet.stack import CLIENT_SECRETS, INFERENCE_NODE, ROBOT, SERVER_SECRETS
    stack = yaml.safe_load(write_stack(REPO / "compose.yaml", REPO / "docker" / "magnitude.yaml", tmp_path,
                                       split=True).read_text())
    services = stack["services"]
    for name in ("inference", "optimizer"):
        assert services[name]["deploy"]["mode"] == "replicated" and services[name]["deploy"]["replicas"] == 1
        assert services[name]["deploy"]["endpoint_mode"] == "dnsrr"
        assert services[name]["deploy"]["placement"]["constraints"] == [INFERENCE_NODE]
        assert not any(isinstance(m, dict) for m in services[name]["volumes"]), "no shared memory over tcp"
        assert {s["source"] for s in services[name]["secrets"]} == {*CLIENT_SECRETS, *SERVER_SECRETS}
    assert services["setup"]["deploy"]["placement"]["constraints"] == [INFERENCE_NODE] and "secrets" not in \
        services["setup"]
    for name in ("embedding", "retrieval", "tools", "gateway", "watchdog"):
        assert services[name]["deploy"]["placement"]["constraints"] == [ROBOT]
        held = {s["source"] for s in services[name]["secrets"]}
        assert held & set(CLIENT_SECRETS) == set(CLIENT_SECRETS) and not held & set(SERVER_SECRETS), name
    endpoints = {name: yaml.safe_load((tmp_path / file).read_text())["runtime"]["endpoints"]
                 for name, file in (("robot", "magnitude.yaml"), ("inference", "magnitude-inference.yaml"),
                                    ("optimizer", "magnitude-optimizer.yaml"))}
    assert endpoints["robot"] == {"inference": "tcp://inference:5555", "optimizer": "tcp://optimizer:5556"}
    assert endpoints["inference"] == {"inference": "tcp://0.0.0.0:5555", "optimizer": "tcp://optimizer:5556"}
    assert endpoints["optimizer"] == {"inference": "tcp://inference:5555", "optimizer": "tcp://0.0.0.0:5556"}
    assert services["inference"]["configs"][0]["source"] == "magnitude_config_inference"
    assert {c for c in stack["configs"]} == {"magnitude_config", "magnitude_config_inference",
                                             "magnitude_config_optimizer"}


def test_the_fleet_commands_say_why_they_have_no_swarm_manager(monkeypatch, tmp_path):
    import docker

    from magnitude.fleet.jobs import FleetError, swarm_client
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(FleetError, match=r"^cannot reach the Docker API \("):
        swarm_client()

    class Worker:  # an engine that answers, in a swarm but not its manager
        def ping(self):
            return True

        def info(self):
            return {"Swarm": {"LocalNodeState": "active", "ControlAvailable": False}}
    monkeypatch.setattr(docker, "from_env", Worker)
    with pytest.raises(FleetError, match="not a Swarm manager"):
        swarm_client()


def test_fleet_status_shows_each_service_once_per_node_with_its_task_and_its_health(monkeypatch, capsys):
    """Swarm's task view and the probes' health are merged: one row per node and service, both sides of a split
    stack placed on one node included (two probes answer for it), a node without the stack one line."""
    from magnitude import fleet_cli
    from magnitude.fleet import jobs
    robots, inference = ["embedding", "gateway", "watchdog"], ["inference", "optimizer"]
    monkeypatch.setattr(jobs, "swarm_view", lambda client, stack: {
        "box": {"role": "robot", "state": "ready", "availability": "active",
                "tasks": {name: "running" for name in robots + inference}},
        "spare": {"role": None, "state": "ready", "availability": "active", "tasks": {}}})
    monkeypatch.setattr(jobs, "placement_groups", lambda client, stack: [("embedding", robots),
                                                                          ("inference", inference)])

    def probe(client, stack, args, beside, progress):  # a probe asks every service of its node
        return [{"node": "box", "what": "status", "decode_tps": 9.5 if beside == "inference" else None,
                 "strategy_age_s": 30.0, "services": {name: {"healthy": name != "tools", "error": None}
                                                      for name in robots + inference + ["tools"]}}]
    monkeypatch.setattr(jobs, "run_probe", probe)
    status = fleet_cli.fleet_status(None, "magnitude")
    box = status["nodes"]["box"]
    assert box["services"] == {name: {"task": "running", "healthy": True, "error": None}
                               for name in robots + inference}
    assert (box["decode_tps"], box["strategy_age_s"]) == (9.5, 30.0)
    assert status["nodes"]["spare"]["services"] == {}
    fleet_cli._print_status(status)
    rows = capsys.readouterr().out.splitlines()[1:]
    assert sorted(row.split()[1] for row in rows if row.startswith("box ")) == sorted(robots + inference)
    assert [row for row in rows if row.startswith("spare ")] == ["spare            (role -, ready: runs none of "
                                                                 "the stack)"]
