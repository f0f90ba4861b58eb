"""The tuning policy on synthetic samples (no model): keep, revert, hysteresis, overrides, settle, re-explore."""

from __future__ import annotations

import random

import pytest

from shared.config import OptimizerConfig, TunableSettings
from services.optimizer.policy import Policy, neighbours, profile

ENGINE = {"n_threads": 2, "prefill_chunk_size": 256, "spec_draft_tokens": 0, "spec_drafter": "lookup",
          "decode_pause_ms": 0, "max_batch_size": 512, "kv_cache_type": "f16"}
WINDOW = 10


class FakeEngine:
    """Applies the policy's target like engine.configure would, and produces samples at given speeds."""

    def __init__(self, policy: Policy, speeds, prefill_tokens=20, completion_tokens=100, noise=0.0, seed=1):
        self.policy, self.speeds = policy, speeds
        self.prefill_tokens, self.completion_tokens = prefill_tokens, completion_tokens
        self.noise, self.rng = noise, random.Random(seed)
        self.settings = dict(ENGINE)
        self.configures = 0
        self._apply()

    def _apply(self) -> None:
        changed = {k for k, v in self.policy.target().items() if self.settings.get(k) != v}
        self.settings.update(self.policy.target())
        self.configures += 1
        sid = str(sorted(self.settings.items()))
        self.policy.applied(dict(self.settings), sid, reloaded=bool(changed & {"max_batch_size", "kv_cache_type"}))

    def sample(self) -> dict:
        prefill_tps, decode_tps = self.speeds(self.settings)
        jitter = 1 + self.rng.uniform(-self.noise, self.noise)
        ttft = self.prefill_tokens / prefill_tps * jitter
        return {"type": "generation", "prefill_tokens": self.prefill_tokens, "completion_tokens": self.completion_tokens,
                "prefill_tps": prefill_tps / jitter, "decode_tps": decode_tps / jitter, "ttft_s": ttft,
                "total_s": ttft + self.completion_tokens / decode_tps * jitter,
                "settings_id": str(sorted(self.settings.items()))}

    def run(self, n: int) -> None:
        for _ in range(n):
            if self.policy.add(self.sample()):
                self._apply()


def make_policy(**overrides) -> Policy:
    config = OptimizerConfig(min_gain=0.05, warmup_samples=1, rebuild_warmup_samples=2,
                             overrides=TunableSettings(**overrides))
    return Policy(config, window=WINDOW, cpu_count=4, clock=lambda: 0.0)


def drafting_helps(s: dict) -> tuple[float, float]:
    return 1000.0, 30.0 * (2.0 if s["spec_draft_tokens"] >= 4 else 1.0)


def everything_hurts(s: dict) -> tuple[float, float]:
    slower = sum(s[k] != v for k, v in ENGINE.items())
    return 1000.0 / (1 + slower), 30.0 / (1 + slower)


def test_profile_classifies_load_and_scores_on_the_reference_request():
    decode_heavy = [{"prefill_tokens": 20, "completion_tokens": 100, "prefill_tps": 1000, "decode_tps": 25,
                     "ttft_s": 0.02, "total_s": 4.02}] * 5
    prefill_heavy = [{"prefill_tokens": 3000, "completion_tokens": 4, "prefill_tps": 1000, "decode_tps": 25,
                      "ttft_s": 3.0, "total_s": 3.16}] * 5
    p = profile(decode_heavy)
    assert p.load_class == "decode" and profile(prefill_heavy).load_class == "prefill"
    assert abs(p.score(p) - (20 / 1000 + 100 / 25)) < 1e-9
    faster = profile([dict(s, decode_tps=50) for s in decode_heavy])
    assert faster.score(p) < p.score(p)  # same reference request, faster decode: lower score


def test_score_does_not_depend_on_the_windows_mix_of_cached_and_cold_prompts():
    # An agent mix: session steps prefill one token (slow per token), cold prompts prefill 600 (fast per token).
    cached = {"prefill_tokens": 1, "completion_tokens": 120, "prefill_tps": 30, "decode_tps": 40,
              "ttft_s": 0.03, "total_s": 3.03}
    cold = {"prefill_tokens": 600, "completion_tokens": 8, "prefill_tps": 300, "decode_tps": 40,
            "ttft_s": 2.0, "total_s": 2.2}
    ref = profile([cached] * 4 + [cold] * 4)
    more_cached, more_cold = profile([cached] * 5 + [cold] * 3), profile([cached] * 3 + [cold] * 5)
    assert abs(more_cached.score(ref) / more_cold.score(ref) - 1) < 0.02  # same speeds: same score


def test_neighbours_stay_in_the_engine_limits():
    assert neighbours("n_threads", {"n_threads": 1}, cpu_count=2) == [2]
    assert neighbours("prefill_chunk_size", {"prefill_chunk_size": 512, "max_batch_size": 512}, 4) == [256]
    assert neighbours("spec_draft_tokens", {"spec_draft_tokens": 0}, 4) == [4]
    assert neighbours("kv_cache_type", {"kv_cache_type": "f16"}, 4) == ["q8_0"]
    assert neighbours("max_batch_size", {"max_batch_size": 256, "prefill_chunk_size": 256}, 4) == [512]


def test_the_draft_model_is_only_tried_when_one_is_configured():
    drafting = {"spec_draft_tokens": 4, "spec_drafter": "lookup"}
    assert neighbours("spec_drafter", drafting, 4) == []
    assert neighbours("spec_drafter", drafting, 4, has_draft_model=True) == ["model"]
    assert neighbours("spec_drafter", {**drafting, "spec_draft_tokens": 0}, 4, has_draft_model=True) == []


def test_keeps_an_improvement():
    policy = make_policy()
    engine = FakeEngine(policy, drafting_helps)
    engine.run(WINDOW * 30)
    assert policy.incumbent["spec_draft_tokens"] >= 4
    kept = [d for d in policy.decisions if d.kept]
    assert kept and kept[0].knob == "spec_draft_tokens" and kept[0].gain > 0.3
    assert policy.phase == "settled"
    assert engine.settings["spec_draft_tokens"] >= 4  # the kept value is what the engine runs


def test_reverts_a_regression_and_settles_on_the_defaults():
    policy = make_policy()
    engine = FakeEngine(policy, everything_hurts)
    engine.run(WINDOW * 30)
    assert policy.decisions and not any(d.kept for d in policy.decisions)
    assert policy.phase == "settled"
    assert engine.settings == ENGINE  # every trial was reverted
    tried = [d.knob for d in policy.decisions]
    decode_knobs, prefill_knobs = {"spec_draft_tokens", "n_threads", "kv_cache_type"}, {"prefill_chunk_size",
                                                                                         "max_batch_size"}
    assert set(tried) == decode_knobs | prefill_knobs
    first_prefill = min(i for i, knob in enumerate(tried) if knob in prefill_knobs)
    assert set(tried[:first_prefill]) == decode_knobs  # the decode-bound candidates first, one at a time
    # spec_drafter has no neighbour while drafting is off, so it is never tried here


def test_a_machine_that_got_quieter_is_not_taken_for_an_improvement():
    """A/B/A: the trial beats the old measurement only because the neighbours' load dropped meanwhile;
    the incumbent's fresh window is just as fast, so the trial is not kept."""
    policy = make_policy()
    calls = {"n": 0}

    def load_drops_after_the_first_window(s: dict) -> tuple[float, float]:
        calls["n"] += 1
        quiet = calls["n"] > WINDOW + 1  # after the incumbent's first window (and its warm-up sample)
        return 1000.0, 30.0 * (1.3 if quiet else 1.0)  # no knob matters, only the machine

    engine = FakeEngine(policy, load_drops_after_the_first_window)
    engine.run(WINDOW * 4)
    first = policy.decisions[0]
    assert first.knob == "spec_draft_tokens" and not first.kept and "re-measured" in first.reason
    assert engine.settings["spec_draft_tokens"] == ENGINE["spec_draft_tokens"]


def test_hysteresis_stops_oscillation():
    # A 2% gain (under min_gain 5%) with 1% noise is not worth a change: nothing is kept, and once
    # settled the engine is not reconfigured again however long the load runs.
    policy = make_policy()
    engine = FakeEngine(policy, lambda s: (1000.0, 30.0 * (1.02 if s != ENGINE else 1.0)), noise=0.01)
    engine.run(WINDOW * 30)
    assert policy.phase == "settled" and not any(d.kept for d in policy.decisions)
    configures = engine.configures
    engine.run(WINDOW * 50)
    assert engine.configures == configures and engine.settings == ENGINE


def test_overrides_are_never_tuned():
    policy = make_policy(n_threads=2)
    engine = FakeEngine(policy, lambda s: (1000.0, 30.0 * (3.0 if s["n_threads"] == 3 else 1.0)))
    engine.run(WINDOW * 30)
    assert all(d.knob != "n_threads" for d in policy.decisions)
    assert policy.target()["n_threads"] == 2 and engine.settings["n_threads"] == 2


def test_warmup_and_stale_samples_are_not_measured():
    policy = make_policy()
    engine = FakeEngine(policy, drafting_helps)
    stale = dict(engine.sample(), settings_id="earlier settings")
    for _ in range(WINDOW * 2):
        policy.add(stale)
    assert policy.window.samples == [] and policy.phase == "measuring"
    policy.add(engine.sample())  # the first one after applying is warm-up
    assert policy.window.samples == []
    policy.add(engine.sample())
    assert len(policy.window.samples) == 1


def test_a_trial_that_fails_more_is_rejected_even_when_faster():
    policy = make_policy()
    engine = FakeEngine(policy, drafting_helps)
    engine.run(WINDOW + 1)  # the baseline window, then the first trial (spec drafting) starts
    assert policy.trial == ("spec_draft_tokens", 4)
    for _ in range(WINDOW):
        policy.outcome(False)
    engine.run(WINDOW + 1)
    first = policy.decisions[0]
    assert first.knob == "spec_draft_tokens" and not first.kept and "failure rate" in first.reason


def test_reexplores_when_the_load_class_changes():
    policy = make_policy()
    engine = FakeEngine(policy, everything_hurts)
    engine.run(WINDOW * 30)
    assert policy.phase == "settled" and policy.reference.load_class == "decode"
    engine.prefill_tokens, engine.completion_tokens = 4000, 2  # now the time goes to prefill
    engine.run(WINDOW + 1)
    assert policy.decisions[-1].reason == "load class changed"
    assert policy.phase == "trial" and policy.trial[0] == "prefill_chunk_size"


def test_refused_trial_moves_on():
    policy = make_policy()
    engine = FakeEngine(policy, drafting_helps)
    engine.run(WINDOW + 1)
    assert policy.trial == ("spec_draft_tokens", 4)
    policy.refused("spec_draft_tokens needs a draft model")
    assert policy.decisions[-1].reason.startswith("engine refused") and policy.trial[0] == "n_threads"


def _drafting_with(model_factor: float):
    """Lookup drafting doubles decode speed; the draft model does ``model_factor`` times what lookup does."""
    def speeds(s: dict) -> tuple[float, float]:
        if not s["spec_draft_tokens"]:
            return 1000.0, 30.0
        return 1000.0, 60.0 * (model_factor if s.get("spec_drafter") == "model" else 1.0)
    return speeds


@pytest.mark.parametrize("model_factor, kept", [(0.9, "lookup"), (1.5, "model")])
def test_the_draft_model_is_kept_only_where_it_beats_lookup(model_factor, kept):
    """Measured here: a 0.5B draft model for the 1.5B decodes slower than lookup on 2 CPU cores; on a faster
    box it may win. Either way the optimizer must end on the faster drafter."""
    config = OptimizerConfig(min_gain=0.05, warmup_samples=1, rebuild_warmup_samples=2)
    policy = Policy(config, window=WINDOW, cpu_count=4, clock=lambda: 0.0, has_draft_model=True)
    engine = FakeEngine(policy, _drafting_with(model_factor))
    engine.run(WINDOW * 40)
    assert engine.settings["spec_draft_tokens"] >= 4 and engine.settings["spec_drafter"] == kept
    assert any(d.knob == "spec_drafter" for d in policy.decisions)  # the draft model was tried
