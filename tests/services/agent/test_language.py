"""Which language a task or an answer is in: named in English where the identifier is sure, else unknown."""

from services.agent.language import ANSWER, TASK, identify


def test_tasks_are_named_in_english_in_every_language_the_bench_has():
    assert identify("How long does the bread in notes/baking.md need to rise?", TASK) == "English"
    assert identify("Wie lange muss das Brot aus notizen/backen.md gehen?", TASK) == "German"
    assert identify("¿Cuánto tiempo tiene que subir el pan de notas/hornear.md?", TASK) == "Spanish"
    assert identify("Combien de temps la pâte de notes/pain.md doit-elle lever ?", TASK) == "French"


def test_a_formula_a_name_or_an_answer_not_surely_in_one_language_is_no_language():
    assert identify("1234 * 56 + 789", TASK) is None
    assert identify("amber-lynx-77", TASK) is None
    assert identify("Oven: Bosch Serie 6 HBG", ANSWER) is None  # a model name: no language it is sure of
