"""Priorities and fair shares on the real model: another key's short request is not stuck behind one key's long
generations, an interactive request is not stuck behind background ones, and a generation paused to make room
for them writes the same tokens as one never paused.

One service with 4 slots (``engine.session_slots``), greedy decoding, no KV reuse (``cache_prompt: false``); the
long generations copy random words from their prompts (``copying_prompt``), so every token of them is sure.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from scripts.bench.prompts import gemma_prompt
from shared.client import Client, GenerateResult
from tests.conftest import REPORT, running_inference

pytestmark = pytest.mark.model

SLOTS = 4
WORDS = ("amber bolt cedar delta ember fjord garnet harbor iris juniper kelp lantern maple nickel onyx pepper "
         "quartz raven saffron tundra umber velvet willow xenon yarrow zephyr").split()


def copying_prompt(seed: int) -> str:
    """40 random words, twice: the model goes on copying them, reading the words back from its own KV.

    Copying is what a long generation here writes because every token of it is sure: a paused one that lost or
    shifted its KV could not go on copying, while the near ties of free prose would let two runs part on batch
    numerics alone (a token's logits move by rounding with the rows decoded beside it: CI saw a story part so)."""
    rng, words = random.Random(seed), []
    while len(words) < 40:  # no word again within 4 (a run of one word is a tie: how many times?)
        words.append(rng.choice([w for w in WORDS if w not in words[-4:]]))
    line = " ".join(words)
    return f"{line}\n{line}\n"


LONG = [copying_prompt(seed) for seed in range(SLOTS)]
SHORT = gemma_prompt([("user", "Say hello.")])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_inference(tmp_path_factory.mktemp("prio", numbered=True), n_ctx=1024,
                           session_slots=SLOTS) as svc:
        yield svc


class Generation(threading.Thread):
    """One streamed generation on its own connection: when its first text came and when it ended."""

    def __init__(self, service, prompt: str, **params):
        super().__init__(daemon=True)
        self.service, self.prompt, self.params = service, prompt, params
        self.decoding = threading.Event()
        self.result: GenerateResult | None = None
        self.first = self.ended = 0.0

    def run(self) -> None:
        with Client(self.service.endpoint, timeout_s=300) as c:
            for piece in c.generate_stream(self.prompt, None, temperature=0, cache_prompt=False, **self.params):
                if isinstance(piece, GenerateResult):
                    self.result = piece
                elif not self.decoding.is_set():
                    self.first = time.monotonic()
                    self.decoding.set()
        self.ended = time.monotonic()


def fill_every_slot(service, **params) -> list[Generation]:
    """The 4 long generations, each decoding before this returns."""
    runs = [Generation(service, prompt, max_tokens=250, **params) for prompt in LONG]
    for run in runs:
        run.start()
    for run in runs:
        assert run.decoding.wait(120)
    return runs


def finish(runs: list[Generation]) -> list[str]:
    for run in runs:
        run.join(300)
    return [run.result.text for run in runs]


@pytest.fixture(scope="module")
def uninterrupted(service) -> list[str]:
    """The 4 long generations' texts when nothing else runs beside them."""
    runs = fill_every_slot(service, owner="key-a")
    texts = finish(runs)
    assert all(run.result.stats.pauses == 0 for run in runs)
    assert all(copies(prompt, text) for prompt, text in zip(LONG, texts)), texts
    return texts


def copies(prompt: str, text: str) -> bool:
    """Whether ``text`` goes on copying the words of ``prompt``."""
    line = prompt.split("\n")[0] + "\n"
    return (line * (len(text) // len(line) + 1)).startswith(text)


def short_request(service, max_tokens: int = 4, **params) -> tuple[GenerateResult, float]:
    with Client(service.endpoint, timeout_s=300) as c:
        result = c.generate(SHORT, None, max_tokens=max_tokens, temperature=0, cache_prompt=False, **params)
    return result, time.monotonic()


def test_another_keys_short_request_finishes_before_one_keys_long_generations(service, uninterrupted):
    """Key A fills every slot with long generations; key B's 4-token request gets a slot at once (one of A's
    pauses) and is answered before any of A's generations ends; A's paused one writes the same text."""
    runs = fill_every_slot(service, owner="key-a")
    sent = time.monotonic()
    _, answered = short_request(service, owner="key-b")
    texts = finish(runs)
    assert all(run.result.stats.completion_tokens == 250 for run in runs)
    assert answered < min(run.ended for run in runs)
    a_seconds = max(run.ended for run in runs) - sent
    assert answered - sent < a_seconds / 4, (answered - sent, a_seconds)
    assert sorted(run.result.stats.pauses for run in runs) == [0, 0, 0, 1]
    assert texts == uninterrupted  # the paused one too: same tokens as never paused
    REPORT.append(f"priority: key B's 4-token request answered in {answered - sent:.2f}s while key A's "
                  f"{SLOTS} x 250-token generations took {a_seconds:.1f}s")


def test_an_interactive_request_pauses_a_background_generation(service, uninterrupted):
    """One key, every slot busy with background generations: its interactive request does not wait for them."""
    runs = fill_every_slot(service, owner="key-a", priority="background")
    short, answered = short_request(service, owner="key-a", priority="interactive")
    texts = finish(runs)
    assert short.stats.priority == "interactive" and short.stats.completion_tokens == 4
    assert answered < min(run.ended for run in runs)
    assert sum(run.result.stats.pauses for run in runs) == 1
    assert texts == uninterrupted


def test_an_interactive_prompt_is_read_before_background_ones(service):
    """Three background requests with long prompts are being read when an interactive one with a prompt as
    long arrives: the prompt tokens of each step go to it first, so its first token comes before theirs."""
    documents = [f"Sensor log {i}. " + " ".join(f"At {t} s sensor {i} read {(t * (i + 3)) % 101} units."
                                              for t in range(60)) + "\nWhat was the highest reading?"
                 for i in range(4)]
    background = [Generation(service, doc, max_tokens=4, priority="background") for doc in documents[:3]]
    for run in background:
        run.start()
    time.sleep(0.2)
    interactive = Generation(service, documents[3], max_tokens=4, priority="interactive")
    interactive.start()
    finish([*background, interactive])
    assert interactive.result.stats.prompt_tokens > 600
    assert interactive.first < min(run.first for run in background), \
        (interactive.first, [run.first for run in background])


def test_within_a_class_one_key_takes_no_slot_from_another_at_its_share(service):
    """Two keys with 2 slots each: a third request of either waits (no pause), in its class, for a slot."""
    runs = [Generation(service, prompt, max_tokens=60, owner=owner)
            for prompt, owner in zip(LONG, ("key-a", "key-a", "key-b", "key-b"))]
    for run in runs:
        run.start()
    for run in runs:
        assert run.decoding.wait(120)
    short, answered = short_request(service, owner="key-a")
    finish(runs)
    assert all(run.result.stats.pauses == 0 for run in runs)
    assert answered >= min(run.ended for run in runs)


def test_aging_lets_a_background_request_through_continuous_interactive_load(tmp_path_factory):
    """Six clients keep interactive requests waiting for the 4 slots for 15 s; a background request that has
    waited two aging bounds counts as interactive, and as the earliest such it gets the next free slot: it is
    answered while the interactive load still runs (without aging it would wait for the load to end)."""
    with running_inference(tmp_path_factory.mktemp("aging", numbered=True), n_ctx=1024, session_slots=SLOTS,
                           priority_aging_s=1.0) as svc:
        until = time.monotonic() + 15
        answered: list[float] = []

        def interactive_load(prompt: str) -> None:
            with Client(svc.endpoint, timeout_s=300) as c:
                while time.monotonic() < until:
                    c.generate(prompt, None, max_tokens=40, temperature=0, cache_prompt=False,
                               priority="interactive")
                    answered.append(time.monotonic())

        load = [threading.Thread(target=interactive_load, args=(p,), daemon=True) for p in LONG + LONG[:2]]
        for thread in load:
            thread.start()
        time.sleep(1.0)  # every slot busy, two more requests waiting
        result, done = short_request(svc, priority="background")
        for thread in load:
            thread.join(120)
        assert result.stats.completion_tokens == 4
        assert done < max(answered) and sum(t > done for t in answered) >= SLOTS, (done, answered)


def test_an_interactive_generation_keeps_its_pace_beside_background_ones(service):
    """Three background generations decode when an interactive one starts: it shares their steps only as
    often as ``engine.priority_pace`` (0.8) allows, so it decodes near its speed alone (a step of 4
    sequences costs nearly 3 of one here: sharing every step would leave it a third) and writes the same
    text; the background ones still finish."""
    def interactive() -> GenerateResult:
        result, _ = short_request(service, priority="interactive", max_tokens=64)
        return result

    short_request(service, priority="interactive")  # step costs of one sequence measured
    alone = interactive()
    runs = [Generation(service, prompt, max_tokens=250, priority="background") for prompt in LONG[:3]]
    for run in runs:
        run.start()
    for run in runs:
        assert run.decoding.wait(120)
    beside = interactive()
    finish(runs)
    assert all(run.result.stats.completion_tokens == 250 for run in runs)
    assert beside.text == alone.text and beside.stats.completion_tokens == 64
    ratio = beside.stats.decode_tps / alone.stats.decode_tps
    assert ratio >= 0.6, (beside.stats.decode_tps, alone.stats.decode_tps)
    REPORT.append(f"priority: interactive decode beside 3 background generations at {ratio:.2f}x of alone "
                  f"({beside.stats.decode_tps} / {alone.stats.decode_tps} tok/s)")
