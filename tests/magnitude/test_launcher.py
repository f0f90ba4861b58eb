"""`magnitude up / health / down` as a user runs them, against the real model."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import CHAT_MODEL_PATH, REPO, make_config, require_model, write_config

pytestmark = pytest.mark.model


def magnitude(config_path, *args, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "magnitude.cli", "--config", str(config_path), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_up_health_generate_down(tmp_path_factory):
    require_model(CHAT_MODEL_PATH)  # an instruct model, as the default agent model is: `generate --chat` needs one
    home = tmp_path_factory.mktemp("l", numbered=True)
    config = make_config(home, model_path=str(CHAT_MODEL_PATH))
    # Even a config that says docker (or auto on a box that is a container with a docker socket) must
    # not make the launcher's watchdog look for containers: `magnitude up` passes the local backend.
    config.watchdog.backend = "docker"
    config_path = write_config(home, config)
    try:
        up = magnitude(config_path, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        health = magnitude(config_path, "health")
        assert health.returncode == 0 and "inference" in health.stdout and "healthy" in health.stdout
        watchdog = json.loads(magnitude(config_path, "health", "--service", "watchdog", "--json").stdout)
        assert watchdog[0]["backend"] == "local", watchdog
        gen = magnitude(config_path, "generate", "--chat", "Say hello to the robot.", "--max-tokens", "12")
        assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
        assert '"completion_tokens"' in gen.stderr
    finally:
        down = magnitude(config_path, "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    after = magnitude(config_path, "health", "--timeout", "1")
    assert after.returncode == 1 and "UNHEALTHY" in after.stdout


def test_bad_config_is_reported(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  n_ctx: -4\n")
    out = magnitude(bad, "health")
    assert out.returncode == 2 and "engine.n_ctx" in out.stderr
