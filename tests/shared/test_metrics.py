"""Metrics: counters that move by the right amounts, the HTTP endpoint, the `metrics` message, `magnitude stats`."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import Client, ServiceError
from scripts.bench.prompts import gemma_prompt
from magnitude.stats_cli import histogram_quantile, restarts_by_service, summarize
from shared.config import ConfigError, parse_config
from shared.metrics import metrics_for
from shared.protocol import Stats
from shared.telemetry import validate_sample
from tests.conftest import ServiceProcess, write_config
from tests.magnitude.test_launcher import magnitude


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in an exposition (0 when absent, as for a counter not yet touched)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def tools_config(home, **metrics):
    home.mkdir(parents=True, exist_ok=True)
    return parse_config({"runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
                         "metrics": {"base_port": 0, **metrics}})


# --- pure functions ------------------------------------------------------------------------------
def test_histogram_quantile_interpolates_within_buckets_like_prometheus():
    buckets = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, float("inf"): 10.0}  # cumulative counts
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / (6 - 2))
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.1 * 1 / 2)
    assert histogram_quantile(0.95, buckets) == 1.0  # rank in +Inf: the highest finite bound
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_a_row_is_summarized_from_a_real_exposition():
    m = metrics_for("inference", 1, queue_depth=lambda: 3, running=lambda: 1, uptime_s=lambda: 9.0)
    for seconds in (0.02, 0.02, 0.2, 0.2):
        m.observe_request("generate", seconds)
    m.observe_request("health", 30.0)  # a probe: must not count
    m.observe_request("generate", 0.01, "busy")
    stats = {"ttft_s": 0.04, "decode_tps": 40.0, "prefill_tps": 500.0,
             "prompt_tokens": 10, "prefill_tokens": 10, "completion_tokens": 5, "priority": "normal", "pauses": 0}
    m.observe_generation(Stats(**stats, cached_tokens=0))
    m.observe_generation(Stats(**{**stats, "cached_tokens": 8, "prefill_tokens": 2, "priority": "interactive"}))
    row = summarize("inference", m.exposition()["text"])
    assert row["requests"] == 5 and row["errors"] == {"busy": 1} and row["queue_depth"] == 3
    assert 10 <= row["p50_ms"] <= 25 and 100 <= row["p95_ms"] <= 250
    assert 25 <= row["ttft_p50_ms"] <= 50 and 30 <= row["decode_tps_p50"] <= 50
    assert row["cache_hit_ratio"] == 0.5 and row["rss_mb"] > 1
    assert m.totals() == {"requests": 6, "errors": 1, "deduplicated": 0}


def test_restarts_come_from_the_watchdogs_counter_summed_over_reasons():
    m = metrics_for("watchdog", 1, queue_depth=lambda: 0, running=lambda: 0, uptime_s=lambda: 1.0)
    restarts = m.counter("restarts_total", "Service restarts by the watchdog.", ["service", "reason"])
    restarts.labels("tools", "dead").inc()
    restarts.labels("tools", "hung").inc()
    restarts.labels("inference", "memory").inc()
    assert restarts_by_service(m.exposition()["text"]) == {"tools": 2, "inference": 1}


def test_metrics_ports_default_to_base_plus_index_and_are_validated():
    cfg = parse_config({}).metrics
    assert (cfg.host, cfg.port("inference"), cfg.port("optimizer")) == ("127.0.0.1", 9464, 9468)
    cfg = parse_config({"metrics": {"base_port": 0, "ports": {"tools": 9100}}}).metrics
    assert (cfg.port("inference"), cfg.port("tools")) == (0, 9100)
    with pytest.raises(ConfigError, match="unknown service"):
        parse_config({"metrics": {"ports": {"nosuch": 1}}})
    with pytest.raises(ConfigError, match="metrics.base_port"):
        parse_config({"metrics": {"base_port": 70000}})


def test_a_generation_sample_keeps_its_priority_and_a_bad_one_is_refused():
    sample = {"type": "generation", "ttft_s": 0.1, "priority": "interactive", "pauses": 1}
    assert validate_sample(sample)["priority"] == "interactive" and validate_sample(sample)["pauses"] == 1
    with pytest.raises(ValueError, match="priority"):
        validate_sample({**sample, "priority": "urgent"})


# --- a real service process (the tool service: no model needed) ------------------------------------
@pytest.fixture(scope="module")
def tools_service(run_home):
    home = run_home / "metrics-tools"
    config = tools_config(home)
    svc = ServiceProcess("tools", write_config(home, config), config).start()
    yield svc
    svc.stop()


def test_error_replies_count_by_code_and_type_over_http(tools_service):
    with Client(tools_service.endpoint, timeout_s=30) as client:
        url = client.health()["metrics_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        before = scrape(url)
        with pytest.raises(ServiceError, match="not_found"):
            client.request("tool.call", {"tool": "no_such_tool", "args": {}})
        with pytest.raises(ServiceError, match="unknown_type"):
            client.request("no.such.type")
        assert client.request("tool.call", {"tool": "calculator", "args": {"expression": "6*7"}})["output"] == "42"
        health = client.health()
    after = scrape(url)

    def moved(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert moved("magnitude_errors_total", code="not_found") == 1
    assert moved("magnitude_errors_total", code="unknown_type") == 1
    assert moved("magnitude_requests_total", type="tool.call") == 2
    assert moved("magnitude_requests_total", type="invalid") == 1  # unknown types never become label values
    assert moved("magnitude_request_seconds_count", type="tool.call") == 2
    assert sample(after, "process_resident_memory_bytes") > 0 and sample(after, "magnitude_uptime_seconds") > 0
    errors_by_code = [s.value for f in text_string_to_metric_families(after) for s in f.samples
                      if s.name == "magnitude_errors_total"]
    assert health["errors"] == sum(errors_by_code)  # health's totals are the metrics' sums


def test_a_scrape_naming_another_host_is_refused(tools_service):
    """Issue 34, finding 9: a web page that re-points its own name at 127.0.0.1 (DNS rebinding) read every
    service's /metrics; its requests still carry its own name as Host, so they are refused as at the gateway."""
    with Client(tools_service.endpoint, timeout_s=30) as client:
        url = client.health()["metrics_url"]
    port = urllib.parse.urlsplit(url).port

    def status(host: str) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Host": host}), timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as err:
            return err.code
    assert [status(h) for h in (f"evil.example:{port}", "evil.example", f"0.0.0.0:{port}", "[::1")] == [400] * 4
    assert [status(h) for h in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}")] == [200] * 3


def test_metrics_message_returns_the_exposition(tools_service):
    with Client(tools_service.endpoint, timeout_s=30) as client:
        reply = client.request("metrics")
    assert reply["content_type"].startswith("text/plain")
    assert sample(reply["text"], "magnitude_service_info", service="tools") == 1


def test_an_occupied_metrics_port_does_not_stop_the_service(run_home):
    home = run_home / "metrics-taken"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = tools_config(home, ports={"tools": taken.getsockname()[1]})
        svc = ServiceProcess("tools", write_config(home, config), config).start()
        try:
            with Client(svc.endpoint, timeout_s=30) as client:
                health = client.health()
                assert health["ok"] and health["metrics_url"] is None
                assert "magnitude_requests_total" in client.request("metrics")["text"]  # still over ZeroMQ
        finally:
            svc.stop()
    assert "metrics_http_failed" in svc.log.read_text()


def test_stats_prints_a_running_service_and_marks_a_stopped_one_down(tools_service):
    args = ["stats", "--service", "tools", "--service", "optimizer", "--timeout", "5"]
    table = magnitude(tools_service.config_path, *args, timeout=60)
    assert table.returncode == 1, table.stderr  # one service is down
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:]}
    assert rows["tools"][1] == "up" and int(rows["tools"][2]) >= 1 and rows["optimizer"][1] == "down"
    as_json = magnitude(tools_service.config_path, *args, "--json", timeout=60)
    by_name = {row["service"]: row for row in json.loads(as_json.stdout)}
    assert by_name["tools"]["status"] == "up" and by_name["tools"]["rss_mb"] > 0
    assert by_name["optimizer"]["status"] == "down" and "unavailable" in by_name["optimizer"]["error"]


# --- the inference service on the real model --------------------------------------------------------
@pytest.mark.model
def test_generation_counters_move_by_the_right_amounts(inference_service):
    history = [("user", "You steer a robot. Name the first room you check.")]
    with Client(inference_service.endpoint, timeout_s=120) as client:
        url = client.health()["metrics_url"]
        before = scrape(url)
        step1 = client.generate(gemma_prompt(history), "metrics-run", max_tokens=8, temperature=0).stats
        history += [("model", "The kitchen."), ("user", "And then?")]
        step2 = client.generate(gemma_prompt(history), "metrics-run", max_tokens=8, temperature=0).stats
    after = scrape(url)

    def moved(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert step1.cached_tokens == 0 and step2.cached_tokens > 0
    assert moved("magnitude_requests_total", type="generate") == 2
    assert moved("magnitude_prefix_cache_requests_total", result="hit") == 1
    assert moved("magnitude_prefix_cache_requests_total", result="miss") == 1
    for kind in ("prompt", "cached", "prefill", "completion"):
        assert moved("magnitude_generation_tokens_total", kind=kind) == getattr(step1, f"{kind}_tokens") + getattr(step2, f"{kind}_tokens")
    assert moved("magnitude_ttft_seconds_count", priority="normal") == 2  # the default class
    assert moved("magnitude_ttft_seconds_sum", priority="normal") == pytest.approx(step1.ttft_s + step2.ttft_s,
                                                                                  abs=1e-3)
    assert moved("magnitude_decode_tokens_per_second_count", priority="normal") == \
        sum(s.decode_tps is not None for s in (step1, step2))
    with Client(inference_service.endpoint, timeout_s=120) as client:
        client.generate(gemma_prompt(history), None, max_tokens=2, temperature=0, priority="background")
    last = scrape(url)
    assert sample(last, "magnitude_ttft_seconds_count", priority="background") - \
        sample(after, "magnitude_ttft_seconds_count", priority="background") == 1
    assert sample(last, "magnitude_ttft_seconds_count", priority="normal") == \
        sample(after, "magnitude_ttft_seconds_count", priority="normal")
