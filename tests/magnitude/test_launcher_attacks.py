"""A failed ``up`` that ``down`` could not stop (issue 23, finding 3)."""

from __future__ import annotations

import pytest

from magnitude import launcher
from shared import process
from shared.health import probe
from tests.conftest import make_config, wait_for, write_config

pytestmark = pytest.mark.security


def test_down_stops_a_stack_process_that_no_pid_file_names(tmp_path):
    """Finding 3: a failed `up` left an inference process without a pid file (its starter, the watchdog, died
    between starting it and writing the file), and `down` said "not running"."""
    config = make_config(tmp_path)
    path = write_config(tmp_path, config)
    proc = process.spawn(config, "tools", str(path))
    try:
        wait_for(lambda: probe(config, "tools", timeout_s=1).healthy, 60, "tools up")
        process.pid_file(config, "tools").unlink()
        outcome = launcher.down(config)
        assert proc.poll() is not None, outcome
        assert any("services.tools" in what and how.startswith("stopped") for what, how in outcome.items()), outcome
        assert process.stack_processes(config) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
