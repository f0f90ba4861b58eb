"""Which language a task or an answer is in: named in English where the identifier is sure, else unknown."""

from services.agent.language import ANSWER, TASK, identify


def test_tasks_are_named_in_english_in_every_language_the_bench_has():
    assert identify("How many litres of stock go into the soup in kitchen/soup.md?", TASK) == "English"
    assert identify("Wie viele Liter Gemüsebrühe kommen in die Suppe aus kueche/suppe.md?", TASK) == "German"
    assert identify("¿Cuántos litros de caldo lleva la sopa de cocina/sopa.md?", TASK) == "Spanish"
    assert identify("Combien de litres de bouillon faut-il pour la soupe de cuisine/soupe.md ?", TASK) == "French"


def test_a_formula_a_name_or_an_answer_not_surely_in_one_language_is_no_language():
    assert identify("1234 * 56 + 789", TASK) is None
    assert identify("amber-lynx-77", TASK) is None
    assert identify("Boiler: Vaillant ecoTEC plus 825", ANSWER) is None  # French, says the identifier, unsure
