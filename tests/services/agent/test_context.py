"""Context budget manager: its logic driven with a word-count tokenizer and a fake summarizer (no services).

The real tokenizer, summarizer and memory are exercised through the agent (tests/services/agent/test_agent.py).
"""

import pytest

from services.agent.context import (FACT_CHARS, MESSAGE_OVERHEAD, SUMMARY_HEADING, ContextManager, Count, Remember,
                                    Summarize, Turn, WorkingMemory, conversion, drive, transcript)
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


# --- the working memory ------------------------------------------------------------------------------
def test_working_memory_names_the_files_still_to_read_and_restates_each_result():
    memory = WorkingMemory("My bike lock code is in the file that todo.txt points to. What is the code?")
    assert memory.unread() == ["todo.txt"]
    other = WorkingMemory(memory.goal)
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
    memory = WorkingMemory("contacts.txt tells where the babysitter's details are. What is her phone number?")
    memory.add("file_reader", '{"path": "contacts.txt"}',
               "Babysitter: details in people/babysitter.txt\nNeighbour: Mr Okafor, flat 2\nRota: rota.txt\n")
    assert memory.unmet("Her number is Mr Okafor, flat 2.") == ["people/babysitter.txt has not been read yet"]
    assert memory.still_to_read("") == ["people/babysitter.txt"]  # not rota.txt: nothing the goal asks about
    memory.add("file_reader", '{"path": "people/babysitter.txt"}', "Phone: 555-0178\n")
    assert memory.unmet("Her number is 555-0178.") == []


def test_working_memory_cuts_a_long_result_and_takes_no_number_for_a_path():
    memory = WorkingMemory("Read log.txt")
    memory.add("file_reader", '{"path": "log.txt"}', "x" * 1000 + " see version 2.4.1, e.g. 0.35 and v1.2")
    assert memory.unread() == []  # 2.4.1, e.g., 0.35 and v1.2 are not files
    assert len(memory.note().splitlines()[2]) < FACT_CHARS + 60 and memory.note().endswith("...")


def test_a_number_is_backed_when_given_read_or_computed_even_rounded():
    memory = WorkingMemory("recipe.txt is for 4 people. How much flour do I need for 10?", ["Max weighs 23 kg."])
    assert memory.invented("You need 625 grams.") == ["625"]  # neither in the goal nor read: made up
    memory.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g")
    memory.add("calculator", '{"expression": "250 * 10 / 4"}', "625.0")
    assert memory.invented("For 10 people (not 4) you need 625 g, 250 g for 4; Max weighs 23 kg.") == []
    memory.add("calculator", '{"expression": "23 * 2.20462"}', "50.70626")
    assert memory.invented("About 51 pounds, or 50.71, at least 50.") == []  # rounded up or down from a result
    assert memory.invented("About 52 pounds, 1,625 g and 50.9.") == ["52", "1625", "50.9"]
    assert WorkingMemory("How many legs does a spider have?").invented("A spider has 8 legs.") == []  # no source


def test_an_answer_in_another_unit_than_the_goal_asks_for_is_not_done():
    memory = WorkingMemory("thermostat.txt has the settings in Fahrenheit. What is the night setting in Celsius?",
                           compute_tool="calculator")
    assert memory.asked_unit() == ("temperature", "Celsius")  # the unit the question asks in: the last one named
    memory.add("file_reader", '{"path": "thermostat.txt"}', "Day: 70 F\nNight: 59 F")
    assert memory.unmet("The night setting is 59 F.") == [
        "the task asks for Celsius, not Fahrenheit; convert with a tool (Fahrenheit to Celsius: subtract 32, then "
        "multiply by 5 / 9)"]
    assert conversion("inches", "centimetres") == "inches to centimetres: multiply by 2.54"
    assert conversion("minutes", "hours") == "minutes to hours: divide by 60"
    assert memory.needs_computing("The night setting is 59 F.")
    memory.add("calculator", '{"expression": "(59 - 32) * 5 / 9"}', "15")
    assert memory.unmet("It is 15 degrees Celsius.") == memory.unmet("15 °C") == []
    minutes = WorkingMemory("How many minutes does the drive take?", compute_tool="calculator")
    minutes.add("memory_search", '{"query": "drive"}', "- The drive takes 2 hours and 40 minutes.")
    assert minutes.wrong_units("2 hours and 40 minutes") == ["hours"]
    assert minutes.unmet("2 hours and 40 minutes") == [
        "the task asks for minutes, not hours; convert with a tool (hours to minutes: multiply by 60)"]
    assert "multiply by 60" not in minutes.note()  # in the note, the 1.5B gave the conversion as its answer
    assert minutes.invented("2 * 60 + 40 = 160") == ["160"]  # the conversion's 60 is given; the sum is not
    assert minutes.wrong_units("160 minutes") == [] and minutes.wrong_units("It is 8 windows away.") == []
    assert WorkingMemory("How tall is the door in my memories?").wrong_units("2 metres") == []  # no unit asked


def test_an_answer_that_only_restates_what_was_found_is_not_done_when_the_goal_asks_to_compute():
    goal = "Look up the monthly rent in my memories and compute what a year of rent costs."
    memory = WorkingMemory(goal, compute_tool="calculator")
    memory.add("memory_search", '{"query": "monthly rent"}', "- The monthly rent is 1840 euros. (score 0.67)")
    assert memory.restated("The monthly rent is 1840 euros.") and memory.needs_computing("It is 1840 euros.")
    assert memory.unmet("The monthly rent is 1840 euros.") == [
        "it only repeats what was found, and the task asks for a result computed from it; compute it with calculator"]
    memory.add("calculator", '{"expression": "1840 * 12"}', "22080")
    assert not memory.restated("A year of rent costs 22080 euros.") and memory.unmet("It costs 22080 euros.") == []
    lookup = WorkingMemory("What does the rent say in my memories?", compute_tool="calculator")  # nothing to compute
    lookup.add("memory_search", '{"query": "rent"}', "- The monthly rent is 1840 euros.")
    assert not lookup.restated("The monthly rent is 1840 euros.")
    no_calculator = WorkingMemory(goal)
    no_calculator.add("memory_search", '{"query": "monthly rent"}', "- The monthly rent is 1840 euros.")
    assert not no_calculator.needs_computing("It is 1840 euros.")


def test_a_count_of_what_a_result_lists_is_backed_when_the_goal_asks_how_many():
    memory = WorkingMemory("How many people said yes in rsvp.txt?")
    memory.add("file_reader", '{"path": "rsvp.txt"}', "Ana: yes\nBruno: no\n\nChiara: yes\n")
    assert memory.invented("Two people said yes.") == [] and memory.invented("2 said yes.") == []
    assert memory.invented("4 said yes.") == ["4"] and memory.invented("1.5 said yes.") == ["1.5"]  # more than listed
    assert WorkingMemory("What is in rsvp.txt?", facts=memory.facts).invented("2 said yes.") == ["2"]


def test_a_list_to_count_is_numbered_in_the_note_and_an_answer_without_a_count_is_not_done():
    memory = WorkingMemory("How many things are on the packing list in packing.txt?", compute_tool="calculator")
    memory.add("file_reader", '{"path": "packing.txt"}', "passports\ntickets\n\nsun cream\n")
    assert memory.counting() and '-> 1. passports / 2. tickets / 3. sun cream' in memory.note()
    assert memory.note().endswith("Count with the numbered lines above; the calculator cannot count.")
    assert memory.unmet("You can count them with len().") == ["it does not say how many"]
    assert memory.unmet("Three things.") == memory.unmet("There are 3.") == []
    assert memory.unmet("Turn yes into 1 and sum:\n```python\nsum(1 for line in f)\n```") == [
        "it writes code instead of answering; the tools do not run it"]
    assert memory.unmet("There are 5.") == ["5 was not read or counted; count the numbered lines found"]
    grams = WorkingMemory("recipe.txt is for 4 people. How many grams of flour do I need for 10?",
                          compute_tool="calculator")
    grams.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g\nmilk: 500 ml\n")
    assert not grams.counting() and "1." not in grams.note()  # how many of a unit: computed, not counted


def test_a_calculation_that_leaves_out_a_figure_of_the_goal_is_not_done():
    memory = WorkingMemory("recipe.txt is for 4 people. How many grams of flour do I need to make it for 10?",
                           compute_tool="calculator")
    memory.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g\n")
    assert memory.unused_figures() == []  # nothing computed yet: nothing left out
    memory.add("calculator", '{"expression": "250 * 10"}', "2500")
    assert memory.unmet("You need 2500 grams.") == ["the task's 4 is in no calculation yet"]
    assert memory.needs_computing("You need 2500 grams.")
    memory.add("calculator", '{"expression": "250 / 4 * 10"}', "625")
    assert memory.unmet("You need 625 grams.") == []
    plants = WorkingMemory("Each plant in plants.txt gets its amount of water twice a week. How many millilitres is "
                           "that per week for all of them?", compute_tool="calculator")
    plants.add("calculator", '{"expression": "200 + 50 + 150"}', "400")
    assert plants.unused_figures() == ["twice"]
    plants.add("calculator", '{"expression": "400 * 2"}', "800")
    assert plants.unused_figures() == []


def test_an_answer_that_leaves_out_what_the_calculator_computed_is_not_done():
    memory = WorkingMemory("Look up the monthly rent in my memories and compute what a year of rent costs.",
                           compute_tool="calculator")
    memory.add("memory_search", '{"query": "monthly rent"}', "- The monthly rent is 1840 euros. (score 0.67)")
    memory.add("calculator", '{"expression": "1840 * 12"}', "22080")
    assert memory.unmet("The monthly rent is 1840 euros.") == [
        "it gives what was found, not what calculator computed from it (22080)"]
    assert memory.omits_result("A year costs 22080 euros, 1840 a month.") is None
    assert not memory.needs_computing("The monthly rent is 1840 euros.")  # computed already: not computed again


def test_an_answer_that_repeats_the_task_or_a_recalled_figure_is_not_done():
    memory = WorkingMemory("The dishwasher's manual is listed in manuals.txt. Which program does it recommend?",
                           ["The electricity price is 0.28 euros per kWh."], compute_tool="calculator")
    memory.add("file_reader", '{"path": "manuals.txt"}', "Dishwasher: manuals/dishwasher.txt\n")
    assert memory.unmet("The dishwasher's manual is listed in manuals.txt.") == [
        "manuals/dishwasher.txt has not been read yet", "it repeats the task instead of answering it"]
    memory.add("file_reader", '{"path": "manuals/dishwasher.txt"}', "Recommended: Delicate\n")
    assert memory.unmet("It recommends Delicate.") == [] and not memory.echoes_goal("The manual.")
    bill = WorkingMemory("Read usage.txt and compute last month's electricity cost.", memory.memories,
                         compute_tool="calculator")
    bill.add("file_reader", '{"path": "usage.txt"}', "Electricity used last month: 350 kWh\n")
    assert bill.restated("The electricity price is 0.28 euros per kWh.")  # a recalled memory is found, not computed


def test_a_calculation_run_again_on_its_own_result_is_told_apart_from_a_next_step():
    memory = WorkingMemory("What does Max weigh in pounds?", compute_tool="calculator")
    memory.add("calculator", '{"expression": "23 * 2.2046"}', "50.7058")
    assert memory.iterates("calculator", '{"expression": "50.7058 * 2.2046"}')
    assert memory.iterates("calculator", '{"expression": "2.2046*50.7058"}')
    assert not memory.iterates("calculator", '{"expression": "50.7058 * 3"}')  # a next step: times another figure
    assert not memory.iterates("calculator", '{"expression": "round(50.7058)"}')
    assert not memory.iterates("file_reader", '{"path": "50.7058 * 2.2046"}')


def test_a_number_read_as_another_kind_of_measure_is_not_backed():
    memory = WorkingMemory("recipe.txt is for 4 people. How many grams of flour do I need for 10?")
    memory.add("file_reader", '{"path": "recipe.txt"}', "flour: 250 g\nmilk: 500 ml\neggs: 2\n")
    assert memory.invented("You need 500 grams of flour.") == ["500"]  # the milk's 500 ml is not a weight
    assert memory.invented("250 grams for 4, and 500 of milk, 2 eggs") == []


def test_the_note_restates_only_the_recalled_memories_that_share_a_word_with_the_goal():
    memory = WorkingMemory("windows.txt lists our windows, and my memories have the cleaner's price per window.",
                           ["The window cleaner charges 4.50 euros per window.", "The bins go out on Wednesday."])
    assert memory.related_memories() == ["The window cleaner charges 4.50 euros per window."]
    assert "Remembered:\n- The window cleaner charges 4.50 euros per window.\n" in memory.note() + "\n"
    assert "Remembered" not in WorkingMemory("What is for dinner on Friday?", memory.memories).note()
