"""The agent benchmark's tasks check what they claim: no question, and no single step of a multi-step task,
passes its own answer check, so a task is solved only by reading and computing, never by echoing."""

from __future__ import annotations

import re

from scripts.bench.agent.grader import correct
from scripts.bench.agent.tasks import FILES, KINDS, MEMORIES, TASKS, available_sets, load_set, load_sets

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


PATH = re.compile(r"[\w./-]+\.(?:txt|csv|ini|md)\b")
TEST_SETS = {"en": "test", "de": "test_de", "es": "test_es", "fr": "test_fr"}


def test_every_file_a_question_names_is_written_by_its_set():
    for name in available_sets():
        tasks, files, _ = load_set(name)
        own = {**FILES, **files} if name == "tune" else files
        for task in tasks:
            assert all(path in own for path in PATH.findall(task.goal)), (name, task.goal)


def test_the_test_set_is_held_out_and_the_same_in_four_languages():
    """At least 40 tasks, each in English, German, Spanish and French, task for task the same kind; its
    files, memories and questions are its own, none of the tune set's."""
    english, files, memories = load_set("test")
    assert len(english) >= 40 and {t.kind for t in english} == set(KINDS)
    tune_goals = {t.goal for t in TASKS}
    for language, name in TEST_SETS.items():
        tasks, files, memories = load_set(name)
        assert [t.kind for t in tasks] == [t.kind for t in english], name
        assert {(t.set, t.language) for t in tasks} == {("test", language)}, name
        assert not set(files) & set(FILES) and not set(memories) & set(MEMORIES), name
        assert not {t.goal for t in tasks} & tune_goals, name


def test_every_file_a_held_out_file_points_to_is_there():
    """A file that names another (house notes naming the alarm's file) names one its set writes, so a miss is
    the agent's, never a missing file's."""
    for name in TEST_SETS.values():
        _, files, _ = load_set(name)
        for path, text in files.items():
            assert all(named in files for named in PATH.findall(text)), (name, path)


def test_the_test_sets_run_together_with_the_others():
    """One run can hold every set: no two write one file differently (load_sets refuses that)."""
    tasks, _, _ = load_sets(available_sets())
    assert len(tasks) == sum(len(load_set(n)[0]) for n in available_sets())


def test_no_single_source_of_a_multi_step_task_in_any_language_holds_its_answer():
    """As for the English tune set, in the held-out sets and the tune set's other languages: neither a file the
    question names nor any memory of the set answers it alone."""
    for name in [*TEST_SETS.values(), "tune_de", "tune_es", "tune_fr"]:
        tasks, files, memories = load_set(name)
        for task in (t for t in tasks if t.kind == "multi_step"):
            named = [text for path, text in files.items() if path in task.goal]
            for text in named + memories:
                assert not correct(text, task.expected, task.language), (name, task.goal, text)


def test_the_false_positive_set_covers_the_rules_that_misfire():
    tasks, _, _ = load_set("fp")
    assert len(tasks) >= 24 and {t.language for t in tasks} == {"en", "de", "es", "fr"}
