"""The scheduler on the real model: mixed batches, fairness, prefixes shared across sessions, restarts.

One service with 4 slots and small prompt chunks (32 tokens per step while anything decodes), so a prompt of a
few hundred tokens is read over many steps, side by side with generations that decode meanwhile.
"""

from __future__ import annotations

import threading
import time

import pytest

from scripts.bench.prompts import gemma_prompt
from shared.client import Client, GenerateResult
from tests.conftest import REPORT, ServiceProcess, make_config, require_model, running_inference, write_config

pytestmark = pytest.mark.model

SYSTEM = ("You are the planner of a warehouse robot. Tools: drive(target) drives to a shelf or a dock; "
          "scan() reads the barcode in front of the camera; lift() lifts the pallet on the forks; lower() "
          "puts it down; report(text) sends a status line to the operator. Plan one step at a time and "
          "check each result before the next. ") * 4
DOCUMENT = "Inventory log. " + " ".join(f"Shelf {i} holds {i * 7 % 13} pallets of item {i * 31 % 97}."
                                        for i in range(1, 130))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_inference(tmp_path_factory.mktemp("sched", numbered=True), n_ctx=2048, session_slots=4,
                           prefill_chunk_size=32) as svc:
        yield svc


@pytest.fixture
def client(service):
    with Client(service.endpoint, timeout_s=120) as c:
        yield c


class Streamer(threading.Thread):
    """One streamed generation on its own connection, recording when each text piece arrived."""

    def __init__(self, service, prompt: str, session: str | None = None, **params):
        super().__init__(daemon=True)
        self.service, self.prompt, self.session, self.params = service, prompt, session, params
        self.times: list[float] = []
        self.result: GenerateResult | None = None
        self.decoding = threading.Event()

    def run(self) -> None:
        with Client(self.service.endpoint, timeout_s=120) as c:
            for piece in c.generate_stream(self.prompt, self.session, temperature=0, **self.params):
                if isinstance(piece, GenerateResult):
                    self.result = piece
                else:
                    self.times.append(time.monotonic())
                    self.decoding.set()


def scheduler_counters(client) -> dict:
    return client.health()["scheduler"]


def test_output_in_mixed_batches_is_the_text_alone(service, client):
    talk = gemma_prompt([("user", "Describe a forklift in three sentences.")])
    long = gemma_prompt([("user", DOCUMENT[:1200] + "\nWhich shelf holds the most pallets?")])
    alone = {name: client.generate(p, None, max_tokens=40, temperature=0, cache_prompt=False).text
             for name, p in (("talk", talk), ("long", long))}
    before = scheduler_counters(client)
    decoder = Streamer(service, talk, max_tokens=40, cache_prompt=False)
    decoder.start()
    assert decoder.decoding.wait(60)
    reader = Streamer(service, long, max_tokens=40, cache_prompt=False)  # its prompt is read while talk decodes
    reader.start()
    decoder.join(120)
    reader.join(120)
    after = scheduler_counters(client)
    assert after["mixed_steps"] - before["mixed_steps"] >= 5, (before, after)  # prompt chunks beside decodes
    assert decoder.result.stats.peak_batch == 2 and reader.result.stats.peak_batch == 2
    assert {"talk": decoder.result.text, "long": reader.result.text} == alone


def test_decodes_keep_flowing_while_a_long_prompt_is_read_and_the_prompt_keeps_moving(service, client):
    decoder = Streamer(service, gemma_prompt([("user", "Count slowly from one to fifty in words.")]),
                       max_tokens=120, cache_prompt=False)
    decoder.start()
    assert decoder.decoding.wait(60)
    sent = time.monotonic()
    reader = Streamer(service, DOCUMENT + "\nHow many shelves are listed?", max_tokens=4, cache_prompt=False)
    reader.start()
    reader.join(180)
    decoder.join(180)
    prompt_tokens = reader.result.stats.prompt_tokens
    first_token = reader.times[0] if reader.times else sent + reader.result.stats.ttft_s
    during = [t for t in decoder.times if sent <= t <= first_token]
    gaps = [b - a for a, b in zip(during, during[1:])]
    # The long prompt took many steps; the generation got a token in (nearly) every one of them ...
    assert prompt_tokens > 900 and len(during) >= 10, (prompt_tokens, len(during))
    assert max(gaps) < (first_token - sent) / 5, (max(gaps), first_token - sent)
    # ... and the prompt was not starved by the decodes: its first token came while they still ran.
    assert first_token < decoder.times[-1]
    REPORT.append(f"scheduler: a {prompt_tokens}-token prompt read in {first_token - sent:.2f}s while another "
                  f"generation decoded {len(during)} tokens (longest gap {max(gaps) * 1000:.0f} ms)")


def test_new_sessions_compute_a_shared_system_prompt_once(service, client):
    prompts = {f"crew-{i}": gemma_prompt([("user", f"{SYSTEM}\nTask: move pallet {i} to dock {i}.")])
               for i in range(3)}
    before = scheduler_counters(client)
    results: dict[str, GenerateResult] = {}

    def step(session: str) -> None:
        with Client(service.endpoint, timeout_s=120) as c:
            results[session] = c.generate(prompts[session], session, max_tokens=16, temperature=0)

    threads = [threading.Thread(target=step, args=(s,)) for s in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stats = sorted((r.stats for r in results.values()), key=lambda s: -s.prefill_tokens)
    leader, followers = stats[0], stats[1:]
    assert leader.kv_source == "cold" and leader.prefill_tokens > 250, leader
    for s in followers:  # they waited for the leader's prefix and copied it
        assert s.kv_source == "shared" and s.shared_tokens > 250 and s.prefill_tokens < 20, s
    assert scheduler_counters(client)["shared_prefix_tokens"] - before["shared_prefix_tokens"] > 500
    for session, prompt in prompts.items():  # the copied KV gives the text computed from scratch
        assert results[session].text == client.generate(prompt, None, max_tokens=16, temperature=0,
                                                        cache_prompt=False).text


def test_a_session_survives_a_graceful_restart(tmp_path_factory):
    require_model()
    home = tmp_path_factory.mktemp("restart", numbered=True)
    config = make_config(home, n_ctx=1024)  # 2 slots: the third session is parked in RAM when the service stops
    path = write_config(home, config)
    turns = {s: [("user", f"You are robot {s}. Name three rooms of a house, {s}.")] for s in ("ra", "rb", "rc")}
    svc = ServiceProcess("inference", path, config).start()
    try:
        with Client(svc.endpoint, timeout_s=120) as c:
            first = {s: c.generate(gemma_prompt(t), s, max_tokens=16, temperature=0) for s, t in turns.items()}
            assert c.request("sessions", session_id="ra")["session"]["where"] == "parked"
    finally:
        svc.stop()  # SIGTERM: drains, then writes every session's KV under DATA_DIR/sessions
    assert len(list((home / "data" / "sessions").glob("*.kv"))) == 3
    svc = ServiceProcess("inference", path, config).start()
    try:
        with Client(svc.endpoint, timeout_s=120) as c:
            assert c.request("sessions", session_id="rb")["session"]["where"] == "disk"
            for s, t in turns.items():
                prompt = gemma_prompt(t + [("model", first[s].text), ("user", "Which one is the largest?")])
                again = c.generate(prompt, s, max_tokens=16, temperature=0)
                assert again.stats.kv_source == "disk", again.stats
                assert again.stats.cached_tokens >= first[s].stats.prompt_tokens, again.stats
                # The same two steps in a twin session that never left memory: same batch shapes, so the text is
                # identical only if the KV that came back from disk is the KV that was saved.
                c.generate(gemma_prompt(t), f"{s}-twin", max_tokens=16, temperature=0, cache_prompt=False)
                assert again.text == c.generate(prompt, f"{s}-twin", max_tokens=16, temperature=0).text
    finally:
        svc.stop()
    # Another KV layout cannot use those files: they are rejected, and the session starts cold.
    q8 = make_config(home, n_ctx=1024, kv_cache_type="q8_0")
    svc = ServiceProcess("inference", write_config(home, q8), q8).start()
    try:
        with Client(svc.endpoint, timeout_s=120) as c:
            prompt = gemma_prompt(turns["ra"] + [("model", first["ra"].text), ("user", "Which one is the largest?")])
            assert c.generate(prompt, "ra", max_tokens=4, temperature=0).stats.kv_source == "cold"
    finally:
        svc.stop()
    assert '"event": "session_file_rejected"' in svc.log.read_text()
