"""How the scheduler shares a step's prompt tokens between the prompts being read (no model needed)."""

from services.inference.scheduler import fair_shares


def test_one_prompt_gets_the_whole_budget_or_what_it_needs():
    assert fair_shares([1000], 256) == [256] and fair_shares([40], 256) == [40] and fair_shares([], 256) == []


def test_long_prompts_share_evenly_and_short_ones_finish_at_once():
    assert fair_shares([1000, 1000], 256) == [128, 128]
    assert fair_shares([1000, 10, 1000], 256) == [123, 10, 123]  # the short one's leftover goes to the others
    assert sum(fair_shares([300, 200, 500, 7], 256)) == 256


def test_never_more_than_the_budget_or_the_need():
    for needs in ([5, 3, 900], [1] * 10, [300, 300, 300]):
        for budget in (1, 7, 64, 512):
            shares = fair_shares(needs, budget)
            assert sum(shares) <= budget and all(0 <= s <= n for s, n in zip(shares, needs))
            assert sum(shares) == min(budget, sum(needs))
