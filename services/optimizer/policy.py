"""The tuning policy: which engine knob to try next, and whether a trial is kept. Pure logic, no I/O.

It sees one generation sample per finished request (prefill and decode
speeds, token counts) and answers with the settings it wants the engine to
run. One knob changes at a time:

1. **measure** the incumbent settings for a full window (``engine.optimization_window``
   samples) and classify the load: prefill-bound when most of the time goes to
   prefill (time to first token), else decode-bound;
2. **try** candidates in the order that suits the load class (prefill-bound:
   prefill_chunk_size, max_batch_size, n_threads first; decode-bound: spec_draft_tokens,
   spec_drafter, n_threads, kv_cache_type first; then the rest). After each change the first samples are discarded
   (warm-up: a rebuild drops cached KV, so the next requests re-prefill), then a
   full window is measured;
3. **confirm, then keep**: a trial whose score beats the incumbent's by
   ``min_gain`` (hysteresis: noise does not flip settings back and forth) and
   whose failure rate is not clearly worse is not kept yet: the incumbent runs
   one more window, and the trial is kept only if it also beats that fresh
   measurement by ``min_gain``. On a shared machine a window's speed drifts with
   the neighbours' load; comparing against a measurement taken just before (A/B/A)
   keeps a quiet moment from passing for an improvement. Otherwise revert;
4. after a pass with no gain (or ``max_passes``), **settle**; a settled window
   whose load class changes or whose score drifts worse by ``drift`` starts over.

Like with like: windows hold different mixes of long prompts and long outputs,
so raw request latency is not comparable between two windows. The score is
the latency of a fixed *reference request* (the mean prefill and completion
token counts of the window that started the exploration), computed from the
window's seconds per prefill token and per decoded token. Those are
token-weighted (all prefill time over all prefill tokens), not medians of
per-request rates: an agent mix holds one-token prefills of cached sessions
(slow per token) beside long cold prompts, and a median flips between the two
populations with the window's composition (measured: a 3x swing between
windows of the same settings). Two windows are compared on the same reference
request, so only speed counts, not which requests happened to arrive.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

from shared.config import KNOBS, OptimizerConfig

LoadClass = Literal["prefill", "decode"]
Phase = Literal["measuring", "trial", "confirm", "settled"]

#: Knobs tried per load class, most promising first; the other class's knobs follow, since an agent
#: mix has both long prompts and long outputs whichever dominates.
CANDIDATE_ORDER: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill_chunk_size", "max_batch_size", "n_threads", "spec_draft_tokens", "spec_drafter",
                "kv_cache_type"),
    "decode": ("spec_draft_tokens", "spec_drafter", "n_threads", "kv_cache_type", "prefill_chunk_size",
               "max_batch_size"),
}
_MAX_DECISIONS = 100


@dataclass(frozen=True)
class Profile:
    """Per-token speeds of one window and the reference request they are scored on."""

    prefill_s_per_token: float | None
    decode_s_per_token: float | None
    ref_prefill_tokens: float
    ref_decode_tokens: float
    load_class: LoadClass

    def score(self, ref: "Profile") -> float:
        """Seconds this window's speeds need for ``ref``'s reference request (lower is better)."""
        total = 0.0
        if ref.prefill_s_per_token is not None and self.prefill_s_per_token is not None:
            total += ref.ref_prefill_tokens * self.prefill_s_per_token
        if ref.decode_s_per_token is not None and self.decode_s_per_token is not None:
            total += ref.ref_decode_tokens * self.decode_s_per_token
        return total


def _seconds_per_token(samples: list[dict], tokens: str, rate: str, least: int) -> float | None:
    """All the time spent on ``tokens`` over their count, for samples with at least ``least`` of them."""
    measured = [(s[tokens], s[tokens] / s[rate]) for s in samples if s.get(tokens, 0) >= least and s.get(rate)]
    count = sum(n for n, _ in measured)
    return sum(t for _, t in measured) / count if count else None


def profile(samples: list[dict]) -> Profile:
    """Token-weighted per-token speeds of a window of generation samples, and its load class."""
    prefill_time = sum(s.get("ttft_s", 0.0) for s in samples)
    decode_time = sum(max(0.0, s.get("total_s", 0.0) - s.get("ttft_s", 0.0)) for s in samples)
    n = max(1, len(samples))
    return Profile(
        prefill_s_per_token=_seconds_per_token(samples, "prefill_tokens", "prefill_tps", 1),
        decode_s_per_token=_seconds_per_token(samples, "completion_tokens", "decode_tps", 2),
        ref_prefill_tokens=sum(s.get("prefill_tokens", 0) for s in samples) / n,
        ref_decode_tokens=sum(s.get("completion_tokens", 0) for s in samples) / n,
        load_class="prefill" if prefill_time >= decode_time else "decode",
    )


def neighbours(knob: str, settings: dict[str, Any], cpu_count: int, has_draft_model: bool = False) -> list[Any]:
    """The values next to the current one that are worth a trial, within the engine's limits."""
    cur = settings.get(knob)
    if cur is None:
        return []
    if knob == "n_threads":
        values = [cur + 1, cur - 1]
        return [v for v in values if 1 <= v <= cpu_count]
    if knob == "prefill_chunk_size":
        top = settings.get("max_batch_size", 4096)
        return [v for v in (cur * 2, cur // 2) if 16 <= v <= top]
    if knob == "max_batch_size":
        low = max(16, settings.get("prefill_chunk_size", 16))
        return [v for v in (cur * 2, cur // 2) if low <= v <= 4096]
    if knob == "spec_draft_tokens":
        return [4] if cur == 0 else [v for v in (cur * 2, cur // 2 if cur >= 4 else 0) if 0 <= v <= 32]
    if knob == "spec_drafter":  # the engine refuses "model" when it has no draft model
        if not settings.get("spec_draft_tokens") or not has_draft_model:
            return []
        return ["model" if cur == "lookup" else "lookup"]
    if knob == "kv_cache_type":
        return ["q8_0" if cur == "f16" else "f16"]
    return []


@dataclass
class Decision:
    ts: float
    knob: str
    old: Any
    new: Any
    kept: bool
    gain: float  # share of the incumbent's score saved (negative: slower)
    reason: str


@dataclass
class Window:
    """Samples and outcomes of the settings now running, after their warm-up."""

    warmup_left: int = 0
    samples: list[dict] = field(default_factory=list)
    ok: int = 0
    failed: int = 0

    @property
    def failure_rate(self) -> float:
        return self.failed / max(1, self.ok + self.failed)


class Policy:
    def __init__(self, config: OptimizerConfig, window: int, cpu_count: int,
                 clock: Callable[[], float] = time.time, has_draft_model: bool = False):
        self.config = config
        self.window_size = window
        self.cpu_count = cpu_count
        self.has_draft_model = has_draft_model
        self.clock = clock
        self.overrides = config.overrides.given()
        self.incumbent: dict[str, Any] = dict(self.overrides)  # the best settings known
        self.trial: tuple[str, Any] | None = None  # (knob, value) under test
        self.phase: Phase = "measuring"
        self.reference: Profile | None = None  # the incumbent's profile; scores are on its reference request
        self.incumbent_failure_rate = 0.0
        self.pending: list[tuple[str, Any]] = []
        self.passes = 0
        self.kept_this_pass = False
        self.decisions: list[Decision] = []
        self.settings_id: str | None = None  # the engine's id for what it runs now
        self.awaiting_apply = False  # target() changed; samples until applied() ran under the old settings
        self.window = Window()
        #: a trial that beat the incumbent, waiting for the incumbent's fresh window: knob, value, profile, failures
        self.confirming: tuple[str, Any, Profile, float] | None = None

    # --- what the engine should run -------------------------------------------------------
    def target(self) -> dict[str, Any]:
        """Incumbent plus the knob under trial; overrides always win."""
        settings = dict(self.incumbent)
        if self.trial is not None:
            settings[self.trial[0]] = self.trial[1]
        return {**settings, **self.overrides}

    def applied(self, engine_settings: dict[str, Any], settings_id: str | None, reloaded: bool) -> None:
        """The engine now runs ``engine_settings``: start a fresh window after the warm-up."""
        for knob in KNOBS:
            if engine_settings.get(knob) is not None:
                self.incumbent.setdefault(knob, engine_settings[knob])  # knobs never set by us: the engine's own value
        self.settings_id = settings_id
        self.awaiting_apply = False
        warmup = self.config.rebuild_warmup_samples if reloaded else self.config.warmup_samples
        self.window = Window(warmup_left=warmup)

    def refused(self, reason: str) -> None:
        """The engine would not take ``target()``: drop the trial, or a learned incumbent that fails here."""
        if self.trial is not None:
            knob, value = self.trial
            self._record(knob, self.incumbent.get(knob), value, False, 0.0, f"engine refused: {reason}")
            self.trial = None
            self._next_trial()
        else:
            self.confirming = None
            self._record("*", self.incumbent, dict(self.overrides), False, 0.0, f"engine refused: {reason}")
            self.incumbent, self.reference, self.phase = dict(self.overrides), None, "measuring"
        self.awaiting_apply = True

    def restart_window(self) -> None:
        """Forget the current window (e.g. it was disturbed by thermal relief)."""
        self.window = Window(warmup_left=self.config.warmup_samples)

    # --- inputs ---------------------------------------------------------------------------
    def outcome(self, ok: bool) -> None:
        """An application or request outcome under the running settings."""
        if ok:
            self.window.ok += 1
        else:
            self.window.failed += 1

    def add(self, sample: dict) -> bool:
        """Take one generation sample; True when ``target()`` changed and must be applied."""
        sid = sample.get("settings_id")
        if self.awaiting_apply or (sid and self.settings_id and sid != self.settings_id):
            return False  # ran under earlier settings
        if self.window.warmup_left > 0:
            self.window.warmup_left -= 1
            return False
        self.window.samples.append(sample)
        if len(self.window.samples) < self.window_size:
            return False
        before = self.target()
        prof = profile(self.window.samples)
        getattr(self, f"_after_{self.phase}")(prof)
        self.window = Window()
        self.awaiting_apply = self.target() != before
        return self.awaiting_apply

    # --- the state machine ------------------------------------------------------------------
    def _after_measuring(self, prof: Profile) -> None:
        self._start_exploring(prof)

    def _gain(self, prof: Profile, incumbent: Profile) -> float:
        """Share of the incumbent's time on the reference request that ``prof``'s speeds save."""
        old_score = incumbent.score(self.reference)
        return 1.0 - prof.score(self.reference) / old_score if old_score > 0 else 0.0

    def _after_trial(self, prof: Profile) -> None:
        knob, value = self.trial
        gain = self._gain(prof, self.reference)
        failure_worse = self.window.failure_rate > self.incumbent_failure_rate + self.config.max_failure_increase
        self.trial = None
        if gain >= self.config.min_gain and not failure_worse:
            self.confirming = (knob, value, prof, self.window.failure_rate)
            self.phase = "confirm"  # target() is the incumbent again for one window
            return
        reason = ("failure rate {:.0%} vs {:.0%}".format(self.window.failure_rate, self.incumbent_failure_rate)
                  if failure_worse else self._scores(prof, self.reference))
        self._record(knob, self.incumbent.get(knob), value, False, gain, reason)
        self._next_trial()

    def _after_confirm(self, incumbent_again: Profile) -> None:
        knob, value, prof, failure_rate = self.confirming
        self.confirming = None
        gain = self._gain(prof, incumbent_again)
        keep = gain >= self.config.min_gain
        self._record(knob, self.incumbent.get(knob), value, keep, gain,
                     f"{self._scores(prof, incumbent_again)} (incumbent re-measured; first measured "
                     f"{self.reference.score(self.reference):.3f}s)")
        if keep:
            self.incumbent[knob] = value
            self.incumbent_failure_rate = failure_rate
            self.kept_this_pass = True
            self.pending = [c for c in self.pending if c[0] != knob]  # this knob found its direction
        # The next trial competes with the freshest speeds of what now runs, on the same reference request.
        best = prof if keep else incumbent_again
        self.reference = Profile(best.prefill_s_per_token, best.decode_s_per_token,
                                 self.reference.ref_prefill_tokens, self.reference.ref_decode_tokens,
                                 best.load_class)
        self._next_trial()

    def _scores(self, prof: Profile, incumbent: Profile) -> str:
        return f"reference request {prof.score(self.reference):.3f}s vs {incumbent.score(self.reference):.3f}s"

    def _after_settled(self, prof: Profile) -> None:
        worse = prof.score(self.reference) > self.reference.score(self.reference) * (1 + self.config.drift)
        if prof.load_class != self.reference.load_class or worse:
            self._record("*", self.reference.load_class, prof.load_class, False, 0.0,
                         "load class changed" if not worse else "settled score drifted worse")
            self._start_exploring(prof)

    def _start_exploring(self, prof: Profile) -> None:
        self.reference = prof
        self.incumbent_failure_rate = self.window.failure_rate
        self.passes = 0
        self._new_pass()
        self._next_trial()

    def _new_pass(self) -> None:
        self.passes += 1
        self.kept_this_pass = False
        order = CANDIDATE_ORDER[self.reference.load_class]
        self.pending = [(knob, v) for knob in order if knob not in self.overrides
                        for v in self._neighbours(knob)]

    def _neighbours(self, knob: str) -> list[Any]:
        return neighbours(knob, self.incumbent, self.cpu_count, self.has_draft_model)

    def _next_trial(self) -> None:
        while True:
            while self.pending:
                knob, value = self.pending.pop(0)
                if self.incumbent.get(knob) != value and value in self._neighbours(knob):
                    self.trial = (knob, value)
                    self.phase = "trial"
                    return
            if not self.kept_this_pass or self.passes >= self.config.max_passes:
                self.phase = "settled"
                return
            self._new_pass()

    def _record(self, knob: str, old: Any, new: Any, kept: bool, gain: float, reason: str) -> None:
        self.decisions.append(Decision(self.clock(), knob, old, new, kept, round(gain, 4), reason))
        del self.decisions[:-_MAX_DECISIONS]

    # --- state for status and the strategy file ------------------------------------------------
    def restore(self, settings: dict[str, Any], reference: Profile | None, settled: bool,
                decisions: list[Decision]) -> None:
        """Start from a saved strategy: a settled one skips the warm-up exploration."""
        self.incumbent = {**settings, **self.overrides}
        self.trial = self.confirming = None
        self.reference = reference
        self.phase = "settled" if settled and reference is not None else "measuring"
        self.decisions = list(decisions)[-_MAX_DECISIONS:]
        self.window = Window(warmup_left=self.config.warmup_samples)

    def status(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "load_class": self.reference.load_class if self.reference else None,
            "window_fill": len(self.window.samples),
            "window_size": self.window_size,
            "warmup_left": self.window.warmup_left,
            "trial": ({"knob": self.trial[0], "value": self.trial[1]} if self.trial is not None else
                      {"knob": self.confirming[0], "value": self.confirming[1], "confirming": True}
                      if self.confirming is not None else None),
            "incumbent": dict(self.incumbent),
            "overrides": dict(self.overrides),
            "score_s": None if self.reference is None else round(self.reference.score(self.reference), 6),
            "decisions": [asdict(d) for d in self.decisions],
        }
