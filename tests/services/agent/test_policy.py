"""The step policy over a run's working memory, with the English rules on: what a step is told (the note),
which files it still needs, and why a candidate answer does not stand yet. The model's questions (the task's
language, its judgment of an answer) are off here; tests/services/agent/test_agent.py drives them."""

from __future__ import annotations

import pytest

from services.agent.context import drive
from services.agent.english_rules import conversion
from services.agent.policy import StepPolicy
from services.agent.working_memory import FACT_CHARS, WorkingMemory
from shared.config.agent import StepPolicyConfig

TOOLS = [{"type": "function", "function": {"name": name, "description": "", "parameters": {
    "type": "object", "properties": {parameter: {"type": "string"}}, "required": [parameter]}}}
    for name, parameter in (("calculator", "expression"), ("file_reader", "path"), ("memory_search", "query"))]


def no_question(op):
    pytest.fail(f"the model was asked {op}: the policy under test asks nothing")


class Checked:
    """A run's working memory under the step policy with every English rule on and no question to the model.
    Its attributes are the English rules' checks, else the working memory's; ``unmet``, ``note`` and
    ``still_to_read`` are the policy's."""

    def __init__(self, goal, memories=(), facts=None, compute_tool=None):
        self.memory = WorkingMemory(goal, memories, facts if facts is not None else [], compute_tool)
        settings = StepPolicyConfig(answer_language=False, judge=False, english_rules="always")
        self.policy = StepPolicy(settings, self.memory, TOOLS)
        drive(self.policy.begin(), no_question)
        self.rules = self.policy.english

    def __getattr__(self, name):
        return getattr(self.rules, name) if hasattr(self.rules, name) else getattr(self.memory, name)

    def unmet(self, answer):
        return drive(self.policy.review(answer), no_question).reasons

    def note(self):
        return self.policy.note()

    def still_to_read(self, answer):
        return self.policy.to_read(answer)


def test_working_memory_names_the_files_still_to_read_and_restates_each_result():
    memory = Checked("My bike lock code is in the file that todo.txt points to. What is the code?")
    assert memory.unread() == ["todo.txt"]
    other = Checked(memory.goal)
    other.add("file_reader", '{"path": "my_todo.txt"}', "Error: not_found: my_todo.txt")
    assert other.unread() == ["todo.txt"]  # another file whose name ends the same is not it
    memory.add("file_reader", '{"path": "todo.txt"}', "Buy stamps\nThe bike lock code is in notes/bike.txt\n")
    assert memory.unread() == ["notes/bike.txt"]  # the goal's file is read; the one it names is not
    note = memory.note()
    assert note.splitlines() == [
        "Task: My bike lock code is in the file that todo.txt points to. What is the code?",
        "Found so far:",
        '- file_reader {"path": "todo.txt"} -> Buy stamps / The bike lock code is in notes/bike.txt',
        "Not read yet: notes/bike.txt."]
    assert memory.unmet("The code is kept in notes/bike.txt.") == ["notes/bike.txt has not been read yet"]
    memory.add("file_reader", '{"path": "index.txt"}', "Menus: menus/week49.txt\nRota: rota.txt\n")
    assert memory.unmet("The lock is on the bike.") == [  # the file todo.txt names for the code, not the index's files
        "notes/bike.txt has not been read yet"]
    assert memory.unmet("See menus/week49.txt.") == ["menus/week49.txt has not been read yet",
                                                     "notes/bike.txt has not been read yet"]
    memory.add("file_reader", '{"path": "notes/bike.txt"}', "Bike lock code: 3817\n")
    assert memory.unread() == ["menus/week49.txt", "rota.txt"] and memory.unread(memory.goal) == []
    assert "Not read yet" not in memory.note()  # the index's other files: nothing the task asks about


def test_a_file_a_result_names_for_what_the_goal_asks_about_is_still_to_read():
    memory = Checked("contacts.txt tells where the babysitter's details are. What is her phone number?")
    memory.add("file_reader", '{"path": "contacts.txt"}',
               "Babysitter: details in people/babysitter.txt\nNeighbour: Mr Okafor, flat 2\nRota: rota.txt\n")
    assert memory.unmet("Her number is Mr Okafor, flat 2.") == ["people/babysitter.txt has not been read yet"]
    assert memory.still_to_read("") == ["people/babysitter.txt"]  # not rota.txt: nothing the goal asks about
    memory.add("file_reader", '{"path": "people/babysitter.txt"}', "Phone: 555-0178\n")
    assert memory.unmet("Her number is 555-0178.") == []


@pytest.mark.parametrize("goal, listing, pointed", [
    ("In kontakte.txt steht, wo die Angaben zur Babysitterin sind. Wie ist ihre Telefonnummer?",
     "Babysitterin: Angaben in personen/babysitterin.txt\nNachbar: Herr Okafor, Wohnung 2\nPutzplan: putzplan.txt",
     "personen/babysitterin.txt"),
    ("Die Anleitung des Geschirrspülers ist in anleitungen.txt eingetragen. Welches Programm empfiehlt sie?",
     "Geschirrspüler: anleitungen/geschirrspueler.txt\nWaschmaschine: anleitungen/waschmaschine.txt",
     "anleitungen/geschirrspueler.txt"),  # an inflection's ending: one word begins the other
    ("La notice du lave-vaisselle est indiquée dans notices.txt. Quel programme recommande-t-elle ?",
     "Lave-vaisselle : notices/lave-vaisselle.txt\nLave-linge : notices/lave-linge.txt",
     "notices/lave-vaisselle.txt"),  # "lave", on every line, tells none apart
    ("indice.txt dice en qué archivo está el menú de esta semana. ¿Qué hay para cenar el viernes?",
     "Menú de esta semana: menus/semana49.txt\nTurnos de limpieza: turnos_limpieza.txt", "menus/semana49.txt"),
])
def test_a_file_a_result_points_to_is_still_to_read_in_any_language(goal, listing, pointed):
    memory = WorkingMemory(goal)
    policy = StepPolicy(StepPolicyConfig(answer_language=False, judge=False, english_rules="off"),
                        memory, TOOLS)
    index = memory.unread()[0]
    memory.add("file_reader", f'{{"path": "{index}"}}', listing)
    assert policy.to_read("") == [pointed]  # not the index's other files: nothing the task asks about
    assert drive(policy.review("555-0142"), no_question).reasons[0] == f"{pointed} has not been read yet"
    memory.add("file_reader", f'{{"path": "{pointed}"}}', "Sanft 40")
    assert policy.to_read("") == []


def test_working_memory_cuts_a_long_result_and_takes_no_number_for_a_path():
    memory = Checked("Read log.txt")
    memory.add("file_reader", '{"path": "log.txt"}', "x" * 1000 + " see version 2.4.1, e.g. 0.35 and v1.2")
    assert memory.unread() == []  # 2.4.1, e.g., 0.35 and v1.2 are not files
    assert len(memory.note().splitlines()[2]) < FACT_CHARS + 60 and memory.note().endswith("...")


def test_a_number_is_backed_when_given_read_or_computed_even_rounded():
    memory = Checked("recipe.txt is for 4 people. How much flour do I need for 10?", ["Max weighs 23 kg."])
    assert memory.invented("You need 625 grams.") == ["625"]  # neither in the goal nor read: made up
    memory.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g")
    memory.add("calculator", '{"expression": "250 * 10 / 4"}', "625.0")
    assert memory.invented("For 10 people (not 4) you need 625 g, 250 g for 4; Max weighs 23 kg.") == []
    memory.add("calculator", '{"expression": "23 * 2.20462"}', "50.70626")
    assert memory.invented("About 51 pounds, or 50.71, at least 50.") == []  # rounded up or down from a result
    assert memory.invented("About 52 pounds, 1,625 g and 50.9.") == ["52", "1625", "50.9"]
    assert Checked("How many legs does a spider have?").invented("A spider has 8 legs.") == []  # no source


def test_an_answer_in_another_unit_than_the_goal_asks_for_is_not_done():
    memory = Checked("thermostat.txt has the settings in Fahrenheit. What is the night setting in Celsius?",
                           compute_tool="calculator")
    assert memory.asked_unit() == ("temperature", "Celsius")  # the unit the question asks in: the last one named
    memory.add("file_reader", '{"path": "thermostat.txt"}', "Day: 70 F\nNight: 59 F")
    assert memory.unmet("The night setting is 59 F.") == [
        "the task asks for Celsius, not Fahrenheit; convert with a tool (Fahrenheit to Celsius: subtract 32, then "
        "multiply by 5 / 9)"]
    assert conversion("inches", "centimetres") == "inches to centimetres: multiply by 2.54"
    assert conversion("minutes", "hours") == "minutes to hours: divide by 60"
    memory.add("calculator", '{"expression": "(59 - 32) * 5 / 9"}', "15")
    assert memory.unmet("It is 15 degrees Celsius.") == memory.unmet("15 °C") == []
    minutes = Checked("How many minutes does the drive take?", compute_tool="calculator")
    minutes.add("memory_search", '{"query": "drive"}', "- The drive takes 2 hours and 40 minutes.")
    assert minutes.wrong_units("2 hours and 40 minutes") == ["hours"]
    assert minutes.unmet("2 hours and 40 minutes") == [
        "the task asks for minutes, not hours; convert with a tool (hours to minutes: multiply by 60)"]
    assert "multiply by 60" not in minutes.note()  # in the note, the 1.5B gave the conversion as its answer
    assert minutes.invented("2 * 60 + 40 = 160") == ["160"]  # the conversion's 60 is given; the sum is not
    assert minutes.wrong_units("160 minutes") == [] and minutes.wrong_units("It is 8 windows away.") == []
    assert Checked("How tall is the door in my memories?").wrong_units("2 metres") == []  # no unit asked


def test_a_count_of_what_a_result_lists_is_backed_when_the_goal_asks_how_many():
    memory = Checked("How many people said yes in rsvp.txt?")
    memory.add("file_reader", '{"path": "rsvp.txt"}', "Ana: yes\nBruno: no\n\nChiara: yes\n")
    assert memory.invented("Two people said yes.") == [] and memory.invented("2 said yes.") == []
    assert memory.invented("4 said yes.") == ["4"] and memory.invented("1.5 said yes.") == ["1.5"]  # more than listed
    assert Checked("What is in rsvp.txt?", facts=memory.facts).invented("2 said yes.") == ["2"]


def test_a_list_to_count_is_numbered_in_the_note_and_an_answer_without_a_count_is_not_done():
    memory = Checked("How many things are on the packing list in packing.txt?", compute_tool="calculator")
    memory.add("file_reader", '{"path": "packing.txt"}', "passports\ntickets\n\nsun cream\n")
    assert memory.counting() and '-> 1. passports / 2. tickets / 3. sun cream' in memory.note()
    assert memory.note().endswith("Count with the numbered lines above; the calculator cannot count.")
    assert memory.unmet("You can count them with len().") == ["it does not say how many"]
    assert memory.unmet("Three things.") == memory.unmet("There are 3.") == []
    assert memory.unmet("Turn yes into 1 and sum:\n```python\nsum(1 for line in f)\n```") == [
        "it writes code instead of answering; the tools do not run it"]
    assert memory.unmet("There are 5.") == ["5 was not read or counted; count the numbered lines found"]
    grams = Checked("recipe.txt is for 4 people. How many grams of flour do I need for 10?",
                          compute_tool="calculator")
    grams.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g\nmilk: 500 ml\n")
    assert not grams.counting() and "1." not in grams.note()  # how many of a unit: computed, not counted


def test_an_answer_that_repeats_the_task_is_sent_to_the_file_a_result_points_to():
    memory = Checked("The dishwasher's manual is listed in manuals.txt. Which program does it recommend?",
                     compute_tool="calculator")
    memory.add("file_reader", '{"path": "manuals.txt"}', "Dishwasher: manuals/dishwasher.txt\n")
    assert memory.unmet("The dishwasher's manual is listed in manuals.txt.") == [
        "manuals/dishwasher.txt has not been read yet"]
    memory.add("file_reader", '{"path": "manuals/dishwasher.txt"}', "Recommended: Delicate\n")
    assert memory.unmet("It recommends Delicate.") == []


def test_an_answer_that_gives_what_was_found_or_repeats_the_tasks_words_stands():
    # the deleted English rules sent these back: "total" read as a request to compute, the flat's 7 as a figure a
    # calculation must use, a yes/no answer in the question's words as an echo
    total = Checked("What is the total on invoice.txt?", compute_tool="calculator")
    total.add("file_reader", '{"path": "invoice.txt"}', "Paint 12.10\nBrushes 6.50\nTotal: 18.60 euros\n")
    assert total.unmet("The total is 18.60 euros.") == []
    floor = Checked("Flat 7 tiles a floor 3 m by 2.5 m: how many square metres is that?", compute_tool="calculator")
    floor.add("calculator", '{"expression": "3 * 2.5"}', "7.5")
    assert floor.unmet("It is 7.5 square metres.") == []
    light = Checked("Read lights.txt. Is the garage light off?", compute_tool="calculator")
    light.add("file_reader", '{"path": "lights.txt"}', "Garage: off\nHall: on\n")
    assert light.unmet("The garage light is off.") == []


def test_a_calculation_run_again_on_its_own_result_is_told_apart_from_a_next_step():
    memory = Checked("What does Max weigh in pounds?", compute_tool="calculator")
    memory.add("calculator", '{"expression": "23 * 2.2046"}', "50.7058")
    assert memory.iterates("calculator", '{"expression": "50.7058 * 2.2046"}')
    assert memory.iterates("calculator", '{"expression": "2.2046*50.7058"}')
    assert not memory.iterates("calculator", '{"expression": "50.7058 * 3"}')  # a next step: times another figure
    assert not memory.iterates("calculator", '{"expression": "round(50.7058)"}')
    assert not memory.iterates("file_reader", '{"path": "50.7058 * 2.2046"}')


def test_a_number_read_as_another_kind_of_measure_is_not_backed():
    memory = Checked("recipe.txt is for 4 people. How many grams of flour do I need for 10?")
    memory.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g\nmilk: 500 ml\neggs: 2\n")
    assert memory.invented("You need 500 grams of flour.") == ["500"]  # the milk's 500 ml is not a weight
    assert memory.invented("250 grams for 4, and 500 of milk, 2 eggs") == []


def test_the_note_restates_only_the_recalled_memories_that_share_a_word_with_the_goal():
    memory = Checked("windows.txt lists our windows, and my memories have the cleaner's price per window.",
                           ["The window cleaner charges 4.50 euros per window.", "The bins go out on Wednesday."])
    assert memory.related_memories() == ["The window cleaner charges 4.50 euros per window."]
    assert "Remembered:\n- The window cleaner charges 4.50 euros per window.\n" in memory.note() + "\n"
    assert "Remembered" not in Checked("What is for dinner on Friday?", memory.memories).note()


def _spec(name, required, *optional):
    properties = {parameter: {"type": "string"} for parameter in (*required, *optional)}
    return {"type": "function", "function": {"name": name, "description": "", "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


def test_a_file_the_task_names_is_read_first_only_where_a_tool_reads_one():
    settings = StepPolicyConfig(answer_language=False, judge=False, english_rules="off")
    acting = [_spec("find", (), "path", "name"), _spec("mv", ("source", "destination")), _spec("cat", ("file_name",))]
    policy = StepPolicy(settings, WorkingMemory("Move report.pdf into the temp folder.", [], []), acting)
    # a path that is optional (find) or one of two (mv) is no file to read: the task acts on the file
    assert policy.first_choice() is None and drive(policy.review("Moved report.pdf."), no_question).reasons == []
    policy = StepPolicy(settings, WorkingMemory("What does report.pdf say?", [], []), [*acting, _spec("read_file", ("path",))])
    assert policy.first_choice() == {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "enum": ["report.pdf"]}}, "required": ["path"]}}}


def test_an_answer_that_names_a_tool_not_called_yet_is_a_plan_asked_again_with_that_tool():
    settings = StepPolicyConfig(answer_language=False, judge=False, english_rules="off")
    tools = [_spec("mkdir", ("dir_name",)), _spec("mv", ("source", "destination"))]
    memory = WorkingMemory("Make a folder temp and move report.pdf into it.", [], [])
    policy = StepPolicy(settings, memory, tools)
    assert drive(policy.review("Use mkdir first."), no_question).reasons == []  # no tool ran: the loop's own re-ask
    memory.add("mkdir", '{"dir_name": "temp"}', "")
    verdict = drive(policy.review("Now you can move it with the `mv` function."), no_question)
    assert verdict.reasons == ["it says to use mv instead of calling it"]
    assert verdict.tool_choice == {"type": "function", "function": {"name": "mv"}}
    assert drive(policy.review("I made temp with mkdir."), no_question).reasons == []  # a report of what was done
    off = StepPolicy(settings.model_copy(update={"plans": False}), memory, tools)
    assert drive(off.review("Now you can move it with the `mv` function."), no_question).reasons == []


def test_a_calculator_call_over_a_tables_columns_is_computed_over_the_values_read():
    """The model names a column of a table it read (in any language: the names are the file's); the loop computes
    it, since the calculator knows no facts. A call that names none is the calculator's."""
    memory = Checked("¿Cuánto dura de media una pasada en robot/runs.csv, en minutos?")
    memory.add("file_reader", '{"path": "robot/runs.csv"}',
               "date,minutes,area_m2\n2026-12-01,42,51\n2026-12-02,36,47\n2026-12-03,45,55\n")
    computed = memory.policy.computed("calculator", {"expression": "sum(minutes) / count(minutes)"})
    assert computed is not None and computed.output == "41" and computed.error is None
    assert memory.policy.computed("calculator", {"expression": "(42 + 36 + 45) / 3"}) is None
    assert memory.policy.computed("file_reader", {"path": "minutes"}) is None
    wrong = memory.policy.computed("calculator", {"expression": "minutes / 3"})
    assert wrong is not None and wrong.output is None and "take its sum, mean" in wrong.error
    memory.policy.settings = StepPolicyConfig(named_facts=False)
    assert memory.policy.computed("calculator", {"expression": "sum(minutes)"}) is None
