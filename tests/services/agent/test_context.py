"""Context budget manager: its logic driven with a word-count tokenizer and a fake summarizer (no services).

The real tokenizer, summarizer and memory are exercised through the agent (tests/services/agent/test_agent.py).
"""

import pytest

from services.agent.context import (MESSAGE_OVERHEAD, SUMMARY_HEADING, ContextManager, Count, Remember, Summarize,
                                    Turn, drive, transcript)
from shared.config import ContextBudget


def words(text: str) -> int:
    return len(text.split())


class Services:
    """Answers the manager's operations: counts words, summarizes as S(first word), remembers turns."""

    def __init__(self):
        self.summaries, self.remembered = [], []

    def __call__(self, op):
        if isinstance(op, Count):
            return words(op.text)
        if isinstance(op, Summarize):
            self.summaries.append([t.text for t in op.turns])
            return " ".join(f"S({t.text.split()[0]})" for t in op.turns)
        assert isinstance(op, Remember)
        self.remembered.extend(op.turns)


def history(n, words_per_turn=12):
    roles = ("assistant", "tool")
    return [Turn(roles[i % 2], f"t{i} " + "word " * (words_per_turn - 1)) for i in range(n)]


def prompt_words(built) -> int:
    return sum(words(m["content"] or "") + MESSAGE_OVERHEAD for m in built.messages)


def test_small_history_is_kept_verbatim_with_memories_before_the_goal():
    services = Services()
    cm = ContextManager(512, ContextBudget(reserve_output=64))
    built = drive(cm.build("You are a robot.", "Where are my keys?", history(3), memories=["keys in blue bowl"]),
                  services)
    assert built.summary is None and built.kept_turns == 3 and not services.summaries
    assert built.messages[0] == {"role": "system", "content": "You are a robot."}
    first = built.messages[1]["content"]
    assert first.index("keys in blue bowl") < first.index("Where are my keys?")
    assert [m["content"] for m in built.messages[2:]] == [t.text for t in history(3)]
    assert set(built.usage) >= {"system", "retrieved", "summary", "goal", "recent", "template", "total"}


@pytest.mark.parametrize("n_ctx", [64, 100, 160, 300])
def test_a_long_history_is_summarized_within_budget_and_remembered(n_ctx):
    services = Services()
    cm = ContextManager(n_ctx, ContextBudget(reserve_output=8), summary_max_tokens=16)
    turns = history(30)
    built = drive(cm.build("You are the planner of a home robot. " * 5, "Tidy the kitchen.", turns,
                           memories=["a memory " * 10] * 4), services)
    assert prompt_words(built) <= built.usage["total"] <= n_ctx - 8
    assert built.summary and built.summarized_turns == 30 - built.kept_turns > 0
    assert SUMMARY_HEADING + "S(" in built.messages[1]["content"]  # the summary stands in for the old turns
    assert "Tidy the kitchen." in built.messages[1]["content"]  # the goal is never summarized away
    assert [t.key for t in services.remembered] == [t.key for t in turns[:built.summarized_turns]]
    if built.kept_turns > 1:  # the kept part starts with a call, not a result without its call
        assert built.messages[2]["role"] != "tool"


def test_summary_leaves_head_room_then_rolls_forward_remembering_each_turn_once():
    services = Services()
    cm = ContextManager(200, ContextBudget(reserve_output=0), summary_max_tokens=20)
    turns = history(20)
    first = drive(cm.build("sys", "goal", turns), services)
    assert len(services.summaries) == 1
    # Head-room: the next steps append to the same prompt without a new summary (the session KV stays valid).
    grown = turns + history(22)[20:]
    again = drive(cm.build("sys", "goal", grown), services)
    assert len(services.summaries) == 1 and again.summary == first.summary
    assert again.messages[:len(first.messages)] == first.messages
    more = drive(cm.build("sys", "goal", turns + history(40)[20:]), services)
    assert len(services.summaries) == 2 and services.summaries[1][0] == first.summary  # extends the old summary
    keys = [t.key for t in services.remembered]
    assert len(keys) == len(set(keys)) == more.summarized_turns


def test_compress_summarizes_even_when_everything_fits():
    services = Services()
    cm = ContextManager(2048, ContextBudget(reserve_output=0))
    built = drive(cm.build("sys", "goal", history(40, 30)), services)
    assert built.summary is None
    compressed = drive(cm.build("sys", "goal", history(40, 30), compress=True), services)
    assert compressed.summary and compressed.summarized_turns > 0
    assert compressed.usage["total"] < built.usage["total"] / 2


def test_oversized_turns_are_cut_to_fit():
    services = Services()
    cm = ContextManager(128, ContextBudget(reserve_output=0))
    built = drive(cm.build("sys", "goal " * 300, [Turn("tool", "long " * 500)]), services)
    assert prompt_words(built) <= 128
    assert built.messages[-1]["content"].endswith("[cut to fit the context]")


def test_observe_learns_the_template_overhead():
    cm = ContextManager(512, ContextBudget(reserve_output=0))
    built = drive(cm.build("sys", "goal", history(2)), Services())
    cm.observe(built, built.usage["total"] + 40)  # the template's tool section was 40 tokens more
    again = drive(cm.build("sys", "goal", history(2)), Services())
    assert again.usage["total"] == built.usage["total"] + 40


def test_budget_shares_are_validated():
    with pytest.raises(ValueError):
        ContextBudget(system=0.5, recent=0.4, retrieved=0.2)
    with pytest.raises(ValueError):
        ContextManager(8)


def test_transcript_names_the_roles():
    assert transcript([Turn("user", "hi"), Turn("tool", "42")]) == "User: hi\nTool: 42"
