"""A drain that compose cut short (issue 23, finding 6)."""

from __future__ import annotations

import pytest

from shared.config import parse_config
from tests.conftest import REPO

pytestmark = pytest.mark.security


def test_compose_grace_covers_the_drain():
    """Finding 6: compose's stop_grace_period (30 s) was shorter than the services' 60 s drain, so inference
    could be killed before its sessions were saved."""
    import yaml
    need = parse_config({}).runtime.stop_timeout_s()
    for name, svc in yaml.safe_load((REPO / "compose.yaml").read_text())["services"].items():
        if svc["command"][:2] == ["python", "-m"]:
            grace = svc["stop_grace_period"]
            assert grace.endswith("s") and float(grace[:-1]) >= need, (name, grace, need)
