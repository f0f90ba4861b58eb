"""English rules: checks of a candidate answer, and hints for the next step, that read English words.

Written for the default model on the tune set's English tasks (docs/agents.md tells which failure each
answers): units after "in" or "how many", "how many" as a count, a stop-word list for what a memory is about.
(Four rules were deleted after they misfired on the false-positive set and paid nothing on the test set: "total",
"left" or "cost" as a request to compute, with the computed figure's absence; every figure of the task, and
"twice", as figures a calculation must use; an answer in the task's words as an echo.) They misread other
languages ("8,40" read as 840, "in Zentimetern" not seen), so the step policy applies them only to a task the model
found to be in English, and only where ``agent.policy.english_rules`` lets it (the ablation in docs/agents.md says
whether they pay).
"""

from __future__ import annotations

import math
import re

from services.agent.working_memory import PATH, NUMBER, WorkingMemory, lines

#: Units a task may ask its answer in, by what they measure: each unit's spellings after a number.
_UNITS = {
    "length": {"millimetres": "mm millimetre millimetres millimeter millimeters",
               "centimetres": "cm centimetre centimetres centimeter centimeters",
               "metres": "m metre metres meter meters", "kilometres": "km kilometre kilometres kilometer kilometers",
               "inches": "inch inches", "feet": "ft foot feet", "miles": "mile miles"},
    "time": {"seconds": "s sec secs second seconds", "minutes": "min mins minute minutes",
             "hours": "h hr hrs hour hours", "days": "day days", "weeks": "week weeks"},
    "mass": {"grams": "g gram grams", "kilograms": "kg kilo kilos kilogram kilograms",
             "pounds": "lb lbs pound pounds", "ounces": "oz ounce ounces"},
    "volume": {"millilitres": "ml millilitre millilitres milliliter milliliters",
               "litres": "l litre litres liter liters", "gallons": "gallon gallons"},
    "temperature": {"Celsius": "c °c celsius", "Fahrenheit": "f °f fahrenheit"},
}
#: Each unit's size in its kind's base unit (metre, second, gram, litre), for the conversion a task needs.
_SIZE = {"millimetres": 0.001, "centimetres": 0.01, "metres": 1, "kilometres": 1000, "inches": 0.0254, "feet": 0.3048,
         "miles": 1609.344, "seconds": 1, "minutes": 60, "hours": 3600, "days": 86400, "weeks": 604800, "grams": 1,
         "kilograms": 1000, "pounds": 453.59237, "ounces": 28.349523125, "millilitres": 0.001, "litres": 1,
         "gallons": 3.785411784}
_TEMPERATURE = {("Fahrenheit", "Celsius"): "subtract 32, then multiply by 5 / 9",
                ("Celsius", "Fahrenheit"): "multiply by 9 / 5, then add 32"}
#: spelling -> (what it measures, the unit's name)
_UNIT_OF = {spelled: (kind, unit) for kind, units in _UNITS.items() for unit, spellings in units.items()
            for spelled in spellings.split()}
_SPELLINGS = "|".join(sorted(map(re.escape, _UNIT_OF), key=len, reverse=True))
#: The unit written right after a number ("7.2 metres", "59 F", "15 degrees Celsius").
_UNIT_AFTER = re.compile(rf"\s?(?:degrees?\s)?({_SPELLINGS})(?![\w°])", re.IGNORECASE)
#: The unit a task asks its answer in ("in centimetres", "how many minutes"); words only, no "m" or "F".
_ASKED_UNIT = re.compile(rf"\b(?:in|into|to|how many(?: more)?)\s+(?:degrees\s)?({_SPELLINGS})\b", re.IGNORECASE)
_WORD = re.compile(r"[\w'.-]*\w")
#: Words a goal and a memory share without being about the same thing.
_COMMON_WORDS = frozenset("what which that this have does with from they them their there many much will would "
                          "should could into about your mine memories memory file files says said tells where "
                          "read".split())
_HOW_MANY = re.compile(r"\bhow many\b", re.IGNORECASE)
#: A reply that writes code (a fenced block), and a goal that asks for code.
_CODE_BLOCK = re.compile(r"```")
_ASKS_FOR_CODE = re.compile(r"\b(?:code|script|program|python|function|snippet)\b", re.IGNORECASE)
#: A count written as a word ("four people said yes").
_COUNT_WORD = re.compile(r"\b(?:none|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
                         r"fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|dozen)\b", re.IGNORECASE)


def _quantities(text: str) -> list[tuple[str, float, tuple[str, str] | None]]:
    """Each number in ``text``: as written (for its decimals), its value, and the unit written after it (what
    it measures, which unit) or None."""
    out = []
    for number in NUMBER.finditer(text):
        written = number.group().replace(",", "")
        try:
            value = float(written)
        except ValueError:  # "1,,2": not a number after all
            continue
        unit = _UNIT_AFTER.match(text, number.end())
        out.append((written, value, _unit(unit.group(1)) if unit else None))
    return out


def _values(text: str) -> list[tuple[str, float]]:
    """Each number in ``text``: as written and its value."""
    return [(written, value) for written, value, _ in _quantities(text)]


def _content_words(text: str) -> set[str]:
    """The words of ``text`` that say what it is about: longer than three letters, not common, no file paths,
    a possessive's "'s" dropped (a memory or a result line "about" the same thing as a goal shares one)."""
    words = (w.removesuffix("'s") for w in _WORD.findall(PATH.sub(" ", text).lower()))
    return {w for w in words if len(w) > 3} - _COMMON_WORDS


def _unit(spelled: str) -> tuple[str, str] | None:
    return _UNIT_OF.get(spelled.lower())


def conversion(source: str, target: str) -> str:
    """How to convert a figure from one unit to another of the same kind, in words: "hours to minutes: multiply
    by 60" (the default model, told to convert 2 hours and 40 minutes, computed 2 * 40)."""
    if (source, target) in _TEMPERATURE:
        how = _TEMPERATURE[source, target]
    else:
        ratio = _SIZE[source] / _SIZE[target]
        how = f"multiply by {ratio:.6g}" if ratio >= 1 else f"divide by {1 / ratio:.6g}"
    return f"{source} to {target}: {how}"


class EnglishRules:
    """The English checks over one run's ``WorkingMemory``."""

    def __init__(self, memory: WorkingMemory):
        self.memory = memory

    @property
    def goal(self) -> str:
        return self.memory.goal

    @property
    def memories(self):
        return self.memory.memories

    @property
    def facts(self) -> list[tuple[str, str, str]]:
        return self.memory.facts

    def invented(self, answer: str) -> list[str]:
        """Numbers in ``answer`` that the goal, the memories, the tool results and the conversions do not hold, even
        rounded up or down to the digits written, as a measure of the same kind where both name a unit (only once
        a tool ran or the goal has numbers: "a spider has 8 legs" needs no source)."""
        known = [(v, unit) for text in (self.goal, *self.memories, *(r for _, _, r in self.facts), *self.conversions())
                 for _, v, unit in _quantities(text)]
        if not self.facts and not _values(self.goal):
            return []
        # A count of what a result lists is computed from it (the goal asks "how many" things a file holds).
        most = max((len(lines(r)) for _, _, r in self.facts), default=0) if _HOW_MANY.search(self.goal) else 0

        def grounded(written: str, value: float, unit: tuple[str, str] | None) -> bool:
            digit = 10.0 ** -len(written.partition(".")[2])  # within one unit of its last digit: 8029 for 8029.7
            return (value.is_integer() and 0 < value <= most) or any(
                (abs(v - value) < digit or math.isclose(v, value, abs_tol=1e-9))
                and (unit is None or source is None or unit[0] == source[0])  # 500 ml does not back 500 g
                for v, source in known)
        return list(dict.fromkeys(w for w, v, unit in _quantities(answer) if not grounded(w, v, unit)))

    def asked_unit(self) -> tuple[str, str] | None:
        """What the goal asks its answer in, and the unit (the last one it names: "settings in Fahrenheit.
        What is the night setting in Celsius?" asks in Celsius)."""
        asked = _ASKED_UNIT.findall(self.goal)
        return _unit(asked[-1]) if asked else None

    def conversions(self) -> list[str]:
        """How to convert each unit the goal, the related memories and the results measure in to the unit the
        goal asks for (same kind, another unit)."""
        if not (want := self.asked_unit()):
            return []
        texts = (self.goal, *self.related_memories(), *(r for _, _, r in self.facts))
        units = dict.fromkeys(u for text in texts for _, _, u in _quantities(text) if u and u[0] == want[0])
        return [conversion(unit, want[1]) for _, unit in units if unit != want[1]]

    def wrong_units(self, answer: str) -> list[str]:
        """Units in ``answer`` that measure what the goal asks for in another unit ("7.2 metres" when it asks
        in centimetres; "2 hours and 40 minutes" when it asks how many minutes)."""
        if not (want := self.asked_unit()):
            return []
        given = [unit for _, _, unit in _quantities(answer) if unit]
        return list(dict.fromkeys(unit for kind, unit in given if kind == want[0] and unit != want[1]))

    def counting(self) -> bool:
        """The goal asks how many things (not how many of a unit), and a result lists several lines: the answer
        is a count of them, which the calculator cannot make (the default model wrote ``count(packing.txt)`` for it)."""
        return bool(_HOW_MANY.search(self.goal)) and not self.asked_unit() and \
            any(len(lines(r)) > 1 for _, _, r in self.facts)

    def unmet(self, answer: str) -> list[str]:
        """Why ``answer`` does not finish the task yet, as far as English words tell; empty when it may stand."""
        reasons = []
        if invented := self.invented(answer):
            was = "was" if len(invented) == 1 else "were"
            reasons.append(f"{', '.join(invented)} {was} not read or counted; count the numbered lines found"
                           if self.counting() else f"{', '.join(invented)} {was} not read or computed with a tool; "
                           "compute with a tool")
        if _HOW_MANY.search(self.goal) and not _values(answer) and not _COUNT_WORD.search(answer):
            reasons.append("it does not say how many")
        if wrong := self.wrong_units(answer):
            want = self.asked_unit()[1]
            reasons.append(f"the task asks for {want}, not {', '.join(wrong)}; convert with a tool ("
                           + "; ".join(conversion(unit, want) for unit in wrong) + ")")
        if _CODE_BLOCK.search(answer) and not _ASKS_FOR_CODE.search(self.goal):  # the default model's plan for a count
            reasons.append("it writes code instead of answering; the tools do not run it")
        return reasons

    def related_memories(self) -> list[str]:
        """The recalled memories that share a word with the goal: restated in the note, since the default model asked
        again for a price it had been given, and answered from an unrelated memory when all were restated."""
        goal = _content_words(self.goal)
        return [m for m in self.memories if goal & _content_words(m)]
