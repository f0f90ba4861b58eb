"""Context budget manager: pure logic with a word-count tokenizer, then the real model's tokenizer and summarizer."""

import pytest

from magnitude.context import ContextManager, Turn, memory_writer, model_summarizer, service_token_counter
from shared.config import ContextBudget


def words(text: str) -> int:
    return len(text.split())


class FakeSummarizer:
    def __init__(self):
        self.calls = []

    def __call__(self, turns, max_tokens):
        self.calls.append([t.text for t in turns])
        return " ".join(f"S({t.text.split()[0]})" for t in turns)[: max_tokens * 4]


def history(n, words_per_turn=12):
    return [Turn("user" if i % 2 == 0 else "model", f"t{i} " + "word " * (words_per_turn - 1)) for i in range(n)]


def test_small_history_is_kept_verbatim():
    cm = ContextManager(512, words, FakeSummarizer(), budget=ContextBudget(reserve_output=64))
    built = cm.build("You are a robot.", history(3), tools=["move_to(room)"], memories=["keys in blue bowl"])
    assert built.summary is None and built.kept_turns == 3
    assert "keys in blue bowl" in built.prompt and "move_to(room)" in built.prompt
    assert built.usage["total"] == words(built.prompt) <= built.usage["budget"]
    assert set(built.usage) >= {"system", "tools", "retrieved", "summary", "recent", "template", "total"}


@pytest.mark.parametrize("n_ctx", [48, 64, 100, 160, 300])
def test_tiny_context_never_overflows_and_summarizes(n_ctx):
    summarizer, remembered = FakeSummarizer(), []
    cm = ContextManager(n_ctx, words, summarizer, remember=remembered.extend, summary_max_tokens=16,
                        budget=ContextBudget(reserve_output=8))
    turns = history(30)
    built = cm.build("You are the planner of a home robot. " * 5, turns, tools=["say(text)"] * 3,
                     memories=["a memory " * 10] * 4, tool_results=["result " * 20])
    assert words(built.prompt) <= n_ctx - 8
    assert built.summary and built.summarized_turns == 30 - built.kept_turns > 0
    assert built.prompt.count("S(t") >= 1  # the summary is in the prompt instead of the old turns
    assert [t.key for t in remembered] == [t.key for t in turns[:built.summarized_turns]]
    assert turns[-1].text.split()[0] in built.prompt  # the current turn is always there


def test_summary_rolls_forward_and_remembers_each_turn_once():
    summarizer, remembered = FakeSummarizer(), []
    cm = ContextManager(120, words, summarizer, remember=remembered.extend, summary_max_tokens=20,
                        budget=ContextBudget(reserve_output=0))
    turns = history(20)
    first = cm.build("sys", turns)
    again = cm.build("sys", turns)
    assert again.summary == first.summary and len(summarizer.calls) == 1  # nothing new: no model call
    more = cm.build("sys", turns + history(26)[20:])
    assert len(summarizer.calls) == 2 and summarizer.calls[1][0] == first.summary  # extends the old summary
    keys = [t.key for t in remembered]
    assert len(keys) == len(set(keys)) == more.summarized_turns


def test_oversized_current_turn_is_cut_to_fit():
    cm = ContextManager(64, words, FakeSummarizer(), budget=ContextBudget(reserve_output=0))
    built = cm.build("sys", [Turn("user", "long " * 500)])
    assert words(built.prompt) <= 64


def test_budget_shares_are_validated():
    with pytest.raises(ValueError):
        ContextBudget(system=0.5, recent=0.4, retrieved=0.2)
    with pytest.raises(ValueError):
        ContextManager(8, words, FakeSummarizer())


@pytest.mark.model
def test_real_tokenizer_and_summarizer(inference_service, memory_services):
    from shared.client import Client
    from magnitude.memory import MemoryClient
    inference = Client(inference_service.endpoint, timeout_s=120)
    memory = MemoryClient(Client(memory_services.retrieval.endpoint, timeout_s=60))
    count = service_token_counter(inference)
    cm = ContextManager(256, count, model_summarizer(inference), memory_writer(memory, "ctx-test", "s1"),
                        budget=ContextBudget(reserve_output=32), summary_max_tokens=48)
    facts = ["My name is Ada and I live in Lisbon.", "The spare key is under the red flower pot.",
             "Remind me to water the fern on Fridays.", "My sister Eva visits on Sundays.",
             "The robot should charge at the kitchen dock.", "I prefer my coffee without sugar."]
    turns = []
    for fact in facts:
        turns += [Turn("user", fact + " Please remember that carefully."), Turn("model", "Noted, I will remember.")]
    turns.append(Turn("user", "Where is the spare key?"))
    built = cm.build("You are a helpful home robot.", turns, memories=["The fern is in the living room."])
    assert count(built.prompt) == built.usage["total"] <= 256 - 32
    assert built.summary and built.summarized_turns > 0
    assert "Summarize" not in built.summary  # a summary, not the instruction echoed back
    print(f"\nreal tokenizer usage: {built.usage}; summary: {built.summary!r}")
    hits = memory.query("ctx-test", text="Ada lives in Lisbon", k=3)
    assert any("Lisbon" in h["text"] for h in hits)  # the summarized originals are in long-term memory
    inference.close()
    memory.close()
