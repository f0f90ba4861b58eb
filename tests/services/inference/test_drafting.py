"""Drafting by n-gram lookup, by a draft model, and the choice of draft length: pure logic, no model."""

from services.inference.drafting import (DraftLength, DraftModel, DraftPolicy, DraftState, MatchAcceptance,
                                         NgramIndex, StepCosts)
from services.inference.sessions import Slot
from shared.config import EngineConfig


def test_the_index_proposes_what_followed_the_latest_occurrence_of_the_last_n_tokens():
    index = NgramIndex(3, shortest=3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0]
    index.extend(tokens)
    assert index.propose([1, 2, 3], 4) == ([7, 8, 0, 1], 3)  # the latest 1 2 3 was followed by 7 8 0, then the tail
    assert index.propose([6], 2) == ([], 0)  # 8 0 6 never occurred
    index = NgramIndex(3, shortest=3)
    index.extend([1, 2, 3, 4, 5, 9, 1, 2])
    assert index.propose([3], 2) == ([4, 5], 3)  # 1 2 3: the last indexed tokens and the tail form the key


def test_the_longest_match_wins_and_a_shorter_one_is_the_fallback():
    index = NgramIndex(4, shortest=2)
    index.extend([7, 1, 2, 3, 4, 9, 2, 3, 5, 1])
    assert index.propose([2, 3], 1) == ([4], 3)  # 1 2 3 occurred (then 4); 2 3 alone last led to 5
    assert index.propose([8, 2, 3], 1) == ([5], 2)  # 8 2 3 never did: the latest 2 3


def test_the_index_grows_with_the_list_it_was_given_and_indexes_each_token_once():
    tokens = [5, 6, 7]
    index = NgramIndex(2)
    index.extend(tokens)
    assert index.propose([5], 3) == ([], 0)  # 7 5 never occurred
    tokens += [5, 6, 7, 8]  # the same list, grown (a task's confirmed tokens)
    index.extend(tokens)
    assert index.propose([5, 6], 3) == ([7, 8, 5], 2)  # 5 6 last occurred late: what followed it, then the tail


def test_step_costs_interpolate_and_extrapolate_what_was_not_measured():
    costs = StepCosts(32)
    assert costs(4) == 0.0  # nothing measured
    costs.observe(1, 0.08)
    costs.observe(9, 0.24)
    assert costs(1) == 0.08 and costs(9) == 0.24
    assert abs(costs(5) - 0.16) < 1e-9
    assert abs(costs(11) - (0.24 + 2 * 0.02)) < 1e-9  # a quarter of one token's step per token
    costs.observe(1, 0.18)
    assert abs(costs(1) - 0.10) < 1e-9  # a moving average


def cpu_like_costs() -> StepCosts:
    """A 1.5B model on 2 threads: 1 + k tokens cost 1.5x for k = 1, about 3x for k = 8."""
    costs = StepCosts(64)
    for n, ms in [(1, 88), (2, 129), (3, 167), (5, 187), (9, 274), (17, 370)]:
        costs.observe(n, ms / 1000)
    return costs


def test_no_drafts_where_acceptance_does_not_pay_for_the_bigger_step():
    length, costs = DraftLength(), cpu_like_costs()
    for _ in range(10):
        length.observe(4, 0)  # the first draft wrong every time
    assert length.choose(8, costs, batch=1, gaining=1) == 0


def test_long_drafts_where_they_are_nearly_always_right():
    length, costs = DraftLength(), cpu_like_costs()
    for _ in range(20):
        length.observe(8, 8)
    assert length.p > 0.95
    assert length.choose(8, costs, batch=1, gaining=1) == 8
    assert length.choose(3, costs, batch=1, gaining=1) == 3  # no more than the lookup found


def test_a_session_that_stopped_drafting_drifts_back_to_trying():
    length, costs = DraftLength(prior=0.75), cpu_like_costs()
    assert length.choose(8, costs, batch=1, gaining=1) > 0  # a long match is worth trying from the start
    for _ in range(10):
        length.observe(4, 0)
    assert length.choose(8, costs, batch=1, gaining=1) == 0
    for _ in range(200):
        length.rest()
    assert abs(length.p - 0.75) < 0.01  # back at the prior
    assert length.choose(8, costs, batch=1, gaining=1) > 0


def test_a_new_session_starts_from_what_the_engine_measured_for_its_match_length():
    acceptance, costs = MatchAcceptance(), cpu_like_costs()
    assert abs(acceptance.start(4).p - 3 / 5) < 1e-9  # nothing measured: (n - 1) / (n + 1)
    for _ in range(10):
        acceptance.observe(4, 3, 0)  # other sessions' drafts from 4-token matches were wrong
    assert acceptance.start(4).p < 0.2
    assert acceptance.start(4).choose(8, costs, batch=1, gaining=1) == 0  # so a new one does not try them
    assert abs(acceptance.start(3).p - 2 / 4) < 1e-9  # other lengths keep their own
    for _ in range(20):
        acceptance.observe(2, 8, 8)
    assert abs(acceptance.start(2).p - 1 / 3) < 1e-9  # right elsewhere never starts a session above the prior


class CountingEvaluator:
    """A draft model whose greedy next token is the last one plus 1, ending at 9; it records its KV per sequence."""

    def __init__(self) -> None:
        self.kv: dict[int, list[int]] = {}
        self.evaluated = 0

    def evaluate(self, tokens: list[int], pos0: int, seq_id: int) -> None:
        kv = self.kv.setdefault(seq_id, [])
        assert len(kv) == pos0, "evaluated at a position its KV does not reach"
        kv.extend(tokens)
        self.evaluated += len(tokens)

    def trim_seq(self, seq_id: int, keep: int) -> None:
        del self.kv.setdefault(seq_id, [])[keep:]

    def argmax(self) -> int:
        return max(max(kv) for kv in self.kv.values() if kv) + 1

    def is_end(self, token: int) -> bool:
        return token >= 9


def test_a_draft_model_continues_greedily_and_evaluates_only_what_changed():
    evaluator = CountingEvaluator()
    model = DraftModel(evaluator)
    assert model.propose(0, [1, 2, 3], 3) == [4, 5, 6]
    assert evaluator.kv[0] == [1, 2, 3, 4, 5]  # the last draft is not evaluated: nothing follows it yet
    evaluator.evaluated = 0
    assert model.propose(0, [1, 2, 3, 4, 7], 5) == [8]  # 4 kept, 5 replaced by 7; ends before 9
    assert evaluator.kv[0] == [1, 2, 3, 4, 7, 8] and evaluator.evaluated == 2
    model.forget()  # a rebuilt context: everything is evaluated again
    evaluator.kv.clear()
    assert model.propose(0, [1, 2], 1) == [3] and evaluator.kv[0] == [1, 2]


def flat_costs() -> StepCosts:
    """Steps that cost the same however many tokens they hold: every draft pays."""
    costs = StepCosts(64)
    costs.observe(1, 0.1)
    costs.observe(64, 0.1)
    return costs


def test_the_policy_drafts_by_lookup_within_room_and_settings_and_learns_per_match_length():
    policy, state = DraftPolicy(EngineConfig(spec_draft_tokens=4, spec_ngram_size=3)), DraftState()
    slot = Slot(seq_id=0, tokens=[1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert policy.propose(state, slot, [3], room=8, costs=flat_costs(), batch=1, gaining=1) == [4, 5, 6, 7]
    assert state.match == 3
    assert policy.propose(state, slot, [3], room=2, costs=flat_costs(), batch=1, gaining=1) == [4, 5]
    policy.observe(state, drafted=2, accepted=0)
    assert (state.drafted, state.accepted) == (2, 0) and state.lengths[3].p < MatchAcceptance.cap(3)
    assert policy.acceptance.start(3).p < MatchAcceptance.cap(3)  # a new generation starts from that
    assert policy.propose(state, slot, [9], room=8, costs=flat_costs(), batch=1, gaining=1) == []
    assert state.match == 0  # no match this step: what it confirms is not put on a match length
    assert policy.propose(DraftState(), slot, [3], room=0, costs=flat_costs(), batch=1, gaining=1) == []
    fresh = DraftState()  # a 3-token match is right half the time at first: not worth a CPU's bigger steps
    assert policy.propose(fresh, slot, [3], room=8, costs=cpu_like_costs(), batch=1, gaining=1) == []
    assert fresh.match == 3


def test_the_policy_takes_a_draft_models_proposal_at_the_set_length():
    evaluator = CountingEvaluator()
    policy = DraftPolicy(EngineConfig(spec_draft_tokens=2, spec_drafter="model", draft_model_path="draft.gguf"),
                         DraftModel(evaluator))
    state = DraftState()
    assert policy.propose(state, Slot(seq_id=1, tokens=[1, 2]), [3], room=8, costs=StepCosts(), batch=1,
                          gaining=1) == [4, 5]
    assert state.match == 0 and evaluator.kv[1] == [1, 2, 3, 4]
