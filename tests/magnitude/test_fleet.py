"""``magnitude fleet stack``: the Swarm stack made from compose.yaml (the deploy itself: tests/system/test_swarm_e2e.py)."""

from __future__ import annotations

from pathlib import Path

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
