"""Who may connect: CURVE on tcp, right key accepted, wrong or no key refused."""


import pytest

from shared.client import Client, CurveKeys, ServiceError
from shared.config import parse_config
from shared.security import SecurityError, create_keys, is_loopback, needs_curve
from tests.conftest import ServiceProcess, free_port, make_config, require_model, write_config


def test_exposure_rules():
    runtime = parse_config({}).runtime
    assert is_loopback("ipc:///tmp/x.sock") and is_loopback("tcp://127.0.0.1:5") and is_loopback("tcp://[::1]:5")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://eth0:5555")
    assert needs_curve(runtime, "tcp://0.0.0.0:5555") and not needs_curve(runtime, "tcp://127.0.0.1:5555")
    forced = parse_config({"runtime": {"curve": True}}).runtime
    assert needs_curve(forced, "tcp://127.0.0.1:5555") and not needs_curve(forced, "ipc:///tmp/a")


def test_exposed_service_without_keys_refuses_to_start(tmp_path):
    import zmq
    from shared.security import CurveServer
    with pytest.raises(SecurityError, match="scripts/ops/keys"):
        CurveServer(zmq.Context.instance(), tmp_path / "nokeys")


@pytest.fixture(scope="module")
def curve_service(tmp_path_factory):
    require_model()
    home = tmp_path_factory.mktemp("curve")
    keys = home / "keys"
    create_keys(keys, ["robot"])
    create_keys(home / "other", ["intruder"])  # a keypair the service never authorized
    base = make_config(home)
    config = parse_config({**base.model_dump(mode="json"), "runtime": {
        **base.runtime.model_dump(mode="json"), "curve": True, "keys_dir": str(keys),
        "endpoints": {"inference": f"tcp://127.0.0.1:{free_port()}"}}})
    svc = ServiceProcess("inference", write_config(home, config), config, curve=CurveKeys(keys, "robot")).start()
    yield svc, home
    svc.stop()


@pytest.mark.model
def test_right_key_accepted_wrong_or_no_key_refused(curve_service):
    svc, home = curve_service
    good = CurveKeys(home / "keys", "robot")
    with Client(svc.endpoint, timeout_s=30, curve=good) as client:
        assert client.health()["ok"]
        assert client.generate("Hello", max_tokens=2).stats.completion_tokens >= 1
    # An unauthorized keypair (right server key) and a client with no keys at all.
    (home / "other" / "server.key").unlink()
    (home / "other" / "server.key").write_bytes((home / "keys" / "server.key").read_bytes())
    for curve in (CurveKeys(home / "other", "intruder"), None):
        with Client(svc.endpoint, timeout_s=5, curve=curve) as client:
            with pytest.raises(ServiceError) as info:
                client.health()
            assert info.value.code == "unauthorized", (curve, info.value)
    with Client(svc.endpoint, timeout_s=30, curve=good) as client:
        assert client.health()["ok"]
