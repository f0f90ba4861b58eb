"""The agent benchmark's tasks check what they claim: no question, and no single step of a multi-step task,
passes its own answer check, so a task is solved only by reading and computing, never by echoing."""

from __future__ import annotations

import re

from scripts.bench.agent.grader import correct
from scripts.bench.agent.tasks import FILES, MEMORIES, TASKS, available_sets, load_set

MULTI = [t for t in TASKS if t.kind == "multi_step"]


def test_there_are_at_least_twenty_multi_step_tasks_of_every_kind_of_chain():
    assert len(MULTI) >= 20
    files = [t for t in MULTI if re.search(r"\w+\.(?:txt|csv)", t.goal)]
    memories = [t for t in MULTI if "memories" in t.goal]
    assert len(files) >= 10 and len(memories) >= 5 and len([t for t in files if t in memories]) >= 3


def test_no_question_passes_its_own_check():
    for task in TASKS:
        assert not correct(task.goal, task.expected), task.goal


def test_no_single_source_of_a_multi_step_task_holds_its_answer():
    """The file the question names and every memory fall short: the answer is in a file that file names, or
    it has to be computed (an agent that stops after its first step fails)."""
    for task in MULTI:
        named = [text for name, text in FILES.items() if name in task.goal]
        assert named or "memories" in task.goal, task.goal
        for text in named + MEMORIES:
            assert not correct(text, task.expected), (task.goal, text)


def test_the_check_reads_numbers_as_numbers_and_phrases_as_words():
    assert correct("It comes to 12.50 euros.", ("12.5",))
    assert correct("The fuel cost 114.56 euros.", ("114.56",))
    assert not correct("The fuel cost 114.5 euros.", ("114.56",))
    assert not correct("It holds 18000 ml.", ("1800",))
    assert correct("The phone number is 555-0178.", ("555-0178",))
    assert not correct("Call 555-01789.", ("555-0178",))
    assert correct("Eleven things.", ("11|eleven",))


def test_no_question_of_any_set_passes_its_own_check_in_its_language():
    for name in available_sets():
        tasks, files, _ = load_set(name)
        assert tasks, name
        for task in tasks:
            assert not correct(task.goal, task.expected, task.language), (name, task.goal)
        for task in (t for t in tasks if t.kind == "file"):
            assert any(path in task.goal for path in {**FILES, **files}), (name, task.goal)
