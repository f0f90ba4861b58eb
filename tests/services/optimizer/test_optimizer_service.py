"""The optimizer process against a stand-in inference process (tests/fake_inference.py): tuning over the
wire, strategy persistence across a full restart, a corrupt strategy file, feedback per strategy, telemetry."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import apsw
import msgpack
import pytest
import zmq

from shared.client import Client
from shared.config import parse_config
from shared.telemetry import Telemetry
from tests.conftest import REPO, ServiceProcess, make_config, require_model, wait_for, write_config
from tests.fake_inference import DEFAULTS

WINDOW = 5


@pytest.fixture
def home():
    path = Path(tempfile.mkdtemp(prefix="mago", dir="/tmp"))  # short: ipc socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_stack(home: Path, **optimizer):
    config = parse_config({
        "engine": {"optimization_window": WINDOW},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False},
        "optimizer": {"warmup_samples": 0, "rebuild_warmup_samples": 0,
                      "thermal": {"sysfs_root": str(home / "sys")}, **optimizer},
    })
    path = write_config(home, config)
    inference = ServiceProcess("inference", path, config, module="tests.fake_inference")
    return config, inference, ServiceProcess("optimizer", path, config)



def ask(svc: ServiceProcess, msg_type: str, body: dict | None = None, session: str | None = None) -> dict:
    with Client(svc.endpoint, timeout_s=10) as c:
        return c.request(msg_type, body, session_id=session)


def generation(settings: dict, settings_id: str, session: str = "s1", decode_tps: float | None = None) -> dict:
    """A decode-bound sample whose speed depends on the settings: drafting doubles decode speed."""
    decode_tps = decode_tps or (60.0 if settings["spec_draft_tokens"] >= 4 else 30.0)
    return {"type": "generation", "session": session, "ok": True, "settings_id": settings_id,
            "prefill_tokens": 20, "completion_tokens": 100, "prefill_tps": 1000.0, "decode_tps": decode_tps,
            "ttft_s": 0.02, "total_s": 0.02 + 100 / decode_tps}


def send_telemetry(optimizer: ServiceProcess, samples: list[dict], pid: int = 4242, service: str = "inference",
                   **body):
    ask(optimizer, "telemetry", {"service": service, "pid": pid, "samples": samples, **body})


def test_tunes_one_knob_at_a_time_and_keeps_what_helps(home):
    config, inference, optimizer = make_stack(home)
    inference.start()
    optimizer.start()
    try:
        wait_for(lambda: ask(inference, "health")["configures"], what="the startup push")
        for _ in range(120):
            health = ask(inference, "health")
            send_telemetry(optimizer, [generation(health["settings"], health["settings_id"])], pid=health["pid"],
                           instance=health["instance"])
            if ask(optimizer, "optimizer.status")["phase"] == "settled":
                break
            time.sleep(0.03)
        status = ask(optimizer, "optimizer.status")
        assert status["phase"] == "settled" and status["load_class"] == "decode"
        kept = [d for d in status["decisions"] if d["kept"]]
        assert kept and kept[0]["knob"] == "spec_draft_tokens"
        # The optimizer's last configure may still be on its way when it reports settled: wait for it to land.
        wait_for(lambda: ask(inference, "health")["settings_id"] == status["settings_id"],
                 what="inference to run the settled settings")
        final = ask(inference, "health")
        assert final["settings"]["spec_draft_tokens"] >= 4 and final["settings"]["n_threads"] == 2
        assert status["settings_id"] == final["settings_id"]
        assert status["processes"]["inference"]["rss_mb"] > 0  # the stand-in's own telemetry thread reports
        for change in final["configures"][1:]:  # one knob under trial at a time, besides the kept drafting
            assert len({k for k, v in change.items() if DEFAULTS[k] != v} - {"spec_draft_tokens"}) <= 1, change
        assert json.loads(optimizer_strategy_file(config).read_text())["settings"]["spec_draft_tokens"] >= 4
    finally:
        optimizer.stop()
        inference.stop()


def optimizer_strategy_file(config) -> Path:
    return config.runtime.resolved_data_dir() / "strategy.json"


def test_strategy_restored_after_a_full_restart_equals_the_dump(home):
    config, inference, optimizer = make_stack(home)
    inference.start()
    optimizer.start()
    wanted = {"format": "magnitude-strategy", "version": 1, "settled": True,
              "settings": {"n_threads": 1, "prefill_chunk_size": 128, "spec_draft_tokens": 8,
                           "priority_pace": 0.5, "priority_aging_s": 10.0},  # the scheduling policy's too
              "profile": {"prefill_s_per_token": 0.001, "decode_s_per_token": 0.02, "ref_prefill_tokens": 600,
                          "ref_decode_tokens": 100, "load_class": "decode"}}
    try:
        ask(optimizer, "strategy.set", {"strategy": wanted})
        wait_for(lambda: ask(inference, "health")["settings"]["spec_draft_tokens"] == 8, what="the pushed strategy")
        in_sync(inference, optimizer)
        dumped = ask(optimizer, "strategy.get")["strategy"]
        full_restart_restores(inference, optimizer, dumped, wanted["settings"])
        assert ask(optimizer, "optimizer.status")["phase"] == "settled"  # no warm-up exploration
        # inference alone restarts: the optimizer notices its new pid and pushes the strategy again
        inference.stop()
        inference.start()
        health = wait_for(lambda: (h := ask(inference, "health"))["configures"] and h, what="the push after restart")
        assert health["settings"]["spec_draft_tokens"] == 8
        # ... and a replaced container's, whose inference has its predecessor's pid: its instance id tells them apart
        send_telemetry(optimizer, [], pid=health["pid"], instance="a-replaced-container", system={"rss_mb": 1.0})
        wait_for(lambda: len(ask(inference, "health")["configures"]) > len(health["configures"]),
                 what="the push to a new instance with the same pid")
        with pytest.raises(Exception, match="strategy rejected: version"):
            ask(optimizer, "strategy.set", {"strategy": dict(wanted, version=2)})
    finally:
        optimizer.stop()
        inference.stop()


def in_sync(inference: ServiceProcess, optimizer: ServiceProcess) -> None:
    """Wait until the optimizer has the reply of its last configure: it knows the settings_id the engine runs."""
    wait_for(lambda: ask(optimizer, "optimizer.status")["settings_id"] == ask(inference, "health")["settings_id"],
             what="the configure reply")


def full_restart_restores(inference: ServiceProcess, optimizer: ServiceProcess, dumped: dict, learned: dict):
    """Stop and start both processes: the engine runs the dumped settings again, and strategy.get equals the dump."""
    optimizer.stop()
    inference.stop()
    inference.start()
    optimizer.start()
    health = wait_for(lambda: (h := ask(inference, "health"))["settings_id"] == dumped["settings_id"] and h,
                      what="the restored strategy on the restarted engine")
    assert {k: health["settings"][k] for k in learned} == learned
    in_sync(inference, optimizer)
    restored = ask(optimizer, "strategy.get")["strategy"]
    assert {**restored, "saved_at": None} == {**dumped, "saved_at": None}


def test_a_corrupt_strategy_file_is_rejected_and_the_service_starts_healthy(home):
    config, _, optimizer = make_stack(home)
    path = optimizer_strategy_file(config)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "magnitude-strategy", "version": 1, "settings": {"n_threads": "many"')
    optimizer.start()
    try:
        assert ask(optimizer, "health")["ok"]
        assert ask(optimizer, "optimizer.status")["phase"] == "measuring"  # defaults
        rejected = [json.loads(line) for line in optimizer.log.read_text().splitlines()
                    if "strategy_rejected" in line]
        assert len(rejected) == 1 and rejected[0]["path"] == str(path) and rejected[0]["reason"]
        assert len(list(path.parent.glob("strategy.json.rejected-*"))) == 1
    finally:
        optimizer.stop()
    assert json.loads(path.read_text())["format"] == "magnitude-strategy"  # a valid one written at stop


def test_feedback_per_strategy_on_a_migrated_table(home):
    config, inference, optimizer = make_stack(home)
    db_path = config.runtime.resolved_data_dir() / "feedback.db"
    db_path.parent.mkdir(parents=True)
    old = apsw.Connection(str(db_path))  # the table as it was before self-optimization
    old.execute("CREATE TABLE feedback (id INTEGER PRIMARY KEY, ts REAL NOT NULL, session_id TEXT NOT NULL, "
                "success INTEGER NOT NULL, error_reason TEXT, details TEXT NOT NULL)")
    old.execute("INSERT INTO feedback (ts, session_id, success, details) VALUES (1, 'old', 1, '{}')")
    old.close()
    inference.start()
    optimizer.start()
    try:
        sid = wait_for(lambda: ask(optimizer, "optimizer.status")["settings_id"], what="the first configure")
        ask(optimizer, "feedback", {"session_id": "run-1", "success": False, "error_reason": "tool loop"})
        ask(optimizer, "feedback", {"session_id": "run-2", "success": True})
        stats = ask(optimizer, "feedback.stats")
        assert stats["total"] == 3 and stats["failed"] == 1
        assert {"settings_id": sid, "succeeded": 1, "failed": 1} in stats["by_strategy"]
        assert {"settings_id": None, "succeeded": 1, "failed": 0} in stats["by_strategy"]
    finally:
        optimizer.stop()
        inference.stop()


def test_compression_advice_and_latency_alert(home):
    _, _, optimizer = make_stack(home, p99_alert_s=1.0, compress_below=0.5)
    optimizer.start()
    try:
        send_telemetry(optimizer, [generation({"spec_draft_tokens": 0}, "x", session="run-7", decode_tps=40.0)])
        send_telemetry(optimizer, [generation({"spec_draft_tokens": 0}, "x", session="run-7", decode_tps=15.0)])
        advice = wait_for(lambda: (a := ask(optimizer, "optimizer.advice", session="run-7"))["last_tps"] == 15.0 and a,
                          what="the second sample")
        assert advice["compress"] is True and advice["start_tps"] == 40.0
        with pytest.raises(Exception, match="needs a session"):
            ask(optimizer, "optimizer.advice")
        send_telemetry(optimizer, [{"type": "tool.call", "latency_s": 3.0, "ok": True}] * WINDOW, service="tools")
        alert = wait_for(lambda: [json.loads(l) for l in optimizer.log.read_text().splitlines() if "latency_alert" in l],
                         what="latency_alert")[0]
        assert alert["service"] == "tools" and alert["p99"] == 3.0 and alert["threshold"] == 1.0
    finally:
        optimizer.stop()


def test_speed_figures_and_latency_alerts_per_priority_class(home):
    """Interactive generations slower than their class's p99 bound raise a latency_alert naming the class;
    background ones as slow do not (no bound for that class); the status shows each class's figures."""
    _, _, optimizer = make_stack(home, p99_alert_s=None, priority_p99_alert_s={"interactive": 2.0})
    optimizer.start()
    try:
        slow = {**generation({"spec_draft_tokens": 0}, "x", decode_tps=30.0), "total_s": 3.4, "ttft_s": 0.1}
        send_telemetry(optimizer, [{**slow, "priority": "background", "total_s": 60.0}] * WINDOW)
        send_telemetry(optimizer, [{**slow, "priority": "interactive"}] * WINDOW)
        figures = wait_for(lambda: (f := ask(optimizer, "optimizer.status")["by_priority"]).get("interactive") and f,
                           what="the interactive samples")
        assert figures["interactive"] == {"generations": WINDOW, "ttft_s_p50": 0.1, "decode_tps_p50": 30.0,
                                          "total_s_p99": 3.4}
        assert figures["background"]["total_s_p99"] == 60.0
        alerts = wait_for(lambda: [json.loads(line) for line in optimizer.log.read_text().splitlines()
                                   if "latency_alert" in line], what="latency_alert")
        assert [(a["priority"], a["p99"], a["threshold"]) for a in alerts] == [("interactive", 3.4, 2.0)]
    finally:
        optimizer.stop()


def test_telemetry_batches_reach_the_optimizer_and_are_dropped_when_it_is_absent(tmp_path):
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='magt', dir='/tmp')}/optimizer.sock"
    router.bind(endpoint)
    telemetry = Telemetry("tools", endpoint, queue_depth=lambda: 3, interval_s=0.05)
    telemetry.start()
    try:
        telemetry.report({"type": "tool.call", "latency_s": 0.1, "ok": True})
        assert router.poll(5000)
        frames = router.recv_multipart()
        body = msgpack.unpackb(frames[-1])["body"]
        while not body["samples"] and router.poll(2000):  # an idle heartbeat may come first
            body = msgpack.unpackb(router.recv_multipart()[-1])["body"]
        assert body["service"] == "tools" and body["samples"][0]["type"] == "tool.call"
        assert body["system"]["queue_depth"] == 3 and body["system"]["rss_mb"] > 0
    finally:
        telemetry.stop()
        router.close(linger=0)
    absent = Telemetry("tools", f"ipc://{tmp_path}/nobody.sock")
    absent.report({"type": "x"})
    absent.flush(ctx.socket(zmq.DEALER))
    assert absent.dropped == 1 and absent.sent == 0


@pytest.mark.model
def test_real_stack_restart_restores_the_dumped_strategy(home):
    """Must show (issue 5): the strategy restored after stopping and starting optimizer and inference equals
    the dump, and the real engine runs it again."""
    require_model()
    config = make_config(home)
    path = write_config(home, config)
    inference, optimizer = ServiceProcess("inference", path, config), ServiceProcess("optimizer", path, config)
    learned = {"n_threads": 1, "prefill_chunk_size": 128, "spec_draft_tokens": 4}
    inference.start()
    optimizer.start()
    try:
        ask(optimizer, "strategy.set", {"strategy": {"format": "magnitude-strategy", "version": 1, "settled": True,
                                                     "settings": learned}})
        wait_for(lambda: all(ask(inference, "health")["settings"][k] == v for k, v in learned.items()),
                 what="the strategy on the engine")
        with Client(inference.endpoint, timeout_s=60) as c:  # telemetry of a real generate reaches the optimizer
            c.generate("The robot moved to the", session_id="run-1", max_tokens=12, temperature=0)
        wait_for(lambda: ask(optimizer, "optimizer.advice", session="run-1")["start_tps"], what="telemetry")
        in_sync(inference, optimizer)
        dumped = ask(optimizer, "strategy.get")["strategy"]
        full_restart_restores(inference, optimizer, dumped, learned)
    finally:
        optimizer.stop()
        inference.stop()


def test_strategy_cli_dump_restore_show(home):
    config, _, optimizer = make_stack(home)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "magnitude.cli", "--config", str(optimizer.config_path),
                               "strategy", *args], capture_output=True, text=True, cwd=REPO, timeout=60)
    down = cli("show")
    assert down.returncode == 1 and "unavailable" in down.stderr and "magnitude up" in down.stderr
    optimizer.start()
    try:
        saved = home / "saved.json"
        saved.write_text(json.dumps({"format": "magnitude-strategy", "version": 1,
                                     "settings": {"spec_draft_tokens": 8}}))
        restored = cli("restore", str(saved))
        assert restored.returncode == 0, restored.stderr
        dumped = cli("dump", "--out", str(home / "dump.json"))
        assert dumped.returncode == 0, dumped.stderr
        assert json.loads((home / "dump.json").read_text())["settings"]["spec_draft_tokens"] == 8
        shown = cli("show")
        assert shown.returncode == 0 and "spec_draft_tokens" in shown.stdout and "phase" in shown.stdout
        bad = home / "bad.json"
        bad.write_text(json.dumps({"format": "magnitude-strategy", "version": 1, "settings": {"n_threads": 999}}))
        refused = cli("restore", str(bad))
        assert refused.returncode == 1 and "settings.n_threads" in refused.stderr
    finally:
        optimizer.stop()


def test_thermal_relief_reaches_the_engine_and_is_undone(home):
    from tests.services.optimizer.test_thermal import FakeBoard
    board = FakeBoard(home / "sys", cores=2)
    board.at(0)
    _, inference, optimizer = make_stack(home, thermal={"sysfs_root": str(home / "sys"), "check_interval_s": 0.2,
                                                        "cool_checks": 2, "max_steps": 1})
    inference.start()
    optimizer.start()
    try:
        wait_for(lambda: ask(inference, "health")["configures"], what="the startup push")
        board.at(301)  # the clock halves
        eased = wait_for(lambda: (s := ask(inference, "health")["settings"])["decode_pause_ms"] == 20 and s,
                         what="thermal relief on the engine")
        assert eased["n_threads"] == 1  # one thread fewer than the stand-in's 2
        status = ask(optimizer, "optimizer.status")
        assert status["relief_level"] == 1 and status["thermal"]["throttled"]
        board.at(0)  # cooled down
        restored = wait_for(lambda: (s := ask(inference, "health")["settings"])["decode_pause_ms"] == 0 and s,
                            what="relief undone")
        assert restored["n_threads"] == 2
        log = optimizer.log.read_text()
        assert "thermal_throttle" in log and "thermal_relief_eased" in log
    finally:
        optimizer.stop()
        inference.stop()
