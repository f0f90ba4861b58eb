"""The step policy: what the agent loop tells the model between steps, and whether a candidate answer stands.

The loop (``services/agent/loop.py``) knows no language: it asks its ``StepPolicy`` for the note after each
step's tool results, for the tool a step should be asked with, and for a ``Verdict`` on each candidate answer.
The default policy is built from mechanisms that do not read the user's words:

- **the task's language**, named before the first step by a statistical identifier (``services.agent.language``),
  or by the model itself where that is unsure (a short answer under a JSON schema, outside the run's session);
  every step is then told to answer in it, and a candidate answer surely in another language is sent back once;
- **the model judging its own answer**: right after a candidate answer, in the run's session (its KV warm), the
  model says under a JSON schema whether that reply is the final answer the task asks for, and what is missing;
- **unread files**: a file the task or the answer names (a path looks the same in every language) is read
  before the answer stands, and a task that names one starts with the reader (a tool whose one required
  parameter is a path; a run without one reads nothing first);
- **backed figures**: a number of the answer that no reading of the task, the memories or the tools' results
  backs (``services.agent.figures``: "1,5" read with either decimal mark) is sent back to be computed;
- **tool names**: a reply that names a tool instead of calling it (before any call), or once tools have run
  names one not called yet (a plan of the next step), is asked again with that tool named;
- **named facts**: a calculator call that names a column of a table the run has read (``sum(minutes) /
  len(minutes)``, ``services.agent.tables``) is computed by the loop over the values read (``shared.arithmetic``):
  the tool, which knows no facts, could only refuse the name.

The checks that read English words (``services.agent.english_rules``) apply only where
``agent.policy.english_rules`` says: by default to a task the model found to be in English.

The policy does no I/O: ``begin`` and ``review`` are generators of ``AskModel`` operations, answered by the loop
with ``chat`` requests (the sans-I/O pattern of the context budget).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Generator

from services.agent import figures, language, tables, topic
from shared.arithmetic import evaluate
from services.agent.english_rules import EnglishRules
from services.agent.working_memory import PATH, WorkingMemory, lines
from shared.config.agent import StepPolicyConfig

#: Asked outside the run's session before its first step; the reply names the language in English, so it can be
#: written into the prompts as it is ("Answer in German.").
LANGUAGE_QUESTION = "In which language is the following text written? Name the language in English.\n\nText: {text}"
LANGUAGE_SCHEMA = {"type": "object", "properties": {"language": {"type": "string", "pattern": "^[A-Z][a-z]{2,15}$"}},
                   "required": ["language"], "additionalProperties": False}
#: Asked right after a candidate answer, in the run's session: the task, the tool results and the reply are
#: all in the prompt above.
JUDGE_QUESTION = ("Check your last reply against the task. Is it the final answer the task asks for (not a plan, "
                  "not a step towards it, not a question back), with every figure taken from the task, the tool "
                  "results or a calculation{language}? If not, say in a few words what is still missing.")
JUDGE_SCHEMA = {"type": "object", "properties": {"final_answer": {"type": "boolean"},
                                                 "missing": {"type": "string", "maxLength": 100}},
                "required": ["final_answer", "missing"], "additionalProperties": False}
#: The names a reader's one required parameter has: the path of the file it reads.
READER_PARAMETERS = ("path", "file", "filename")
#: The tool that calculates, when the run has it: the English rules send a wrong unit to it.
COMPUTE_TOOL = "calculator"


@dataclass(frozen=True)
class AskModel:
    """Operation: the model's reply, a JSON object under ``schema``, to ``question`` (reply: the object, or None
    when the model could not give one). ``about``: a candidate answer the question is about; it is asked in the
    run's session right after that reply, else on its own, outside the session."""

    question: str
    schema: dict
    about: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A candidate answer's review: ``reasons`` it does not stand yet (empty: it stands), the tool the next step
    is asked with (a ``tool_choice`` map; None: the model picks), and what the model is told to do next."""

    reasons: list[str] = field(default_factory=list)
    tool_choice: dict | None = None
    then: str = "Call the tool for the missing step."


@dataclass(frozen=True)
class Computed:
    """A tool call the policy computed itself: its ``output``, or the ``error`` that says why it could not."""

    output: str | None = None
    error: str | None = None


def named(tool: str, parameters: dict | None = None) -> dict:
    """The ``tool_choice`` that asks for one tool (its arguments under ``parameters``, a narrower schema than the
    tool's own, when given: protocol.ChosenFunction)."""
    function = {"name": tool} if parameters is None else {"name": tool, "parameters": parameters}
    return {"type": "function", "function": function}


def _arguments(text: str) -> dict:
    """A call's arguments as the model wrote them, as a map ({} when they are no JSON object)."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return given if isinstance(given, dict) else {}


def mentions(names: list[str]) -> re.Pattern[str]:
    """Finds a tool named in prose, as models spell it there (``file_reader``, "file reader", "File-Reader"); the
    match's ``lastgroup`` is ``t<index>`` of the tool in ``names``."""
    spelled = (r"[_\s-]".join(re.escape(part) for part in re.split(r"[_\s-]", name)) for name in names)
    return re.compile("|".join(rf"(?P<t{i}>\b{s}\b)" for i, s in enumerate(spelled)) or "(?!)", re.IGNORECASE)


def _readers(specs: list[dict]) -> dict[str, str]:
    """The tools that read a file, each with its path parameter: a tool whose one required parameter is a path
    (``file_reader(path)``, a caller's ``read_file(path)``; not ``find(path, name)``, whose path is optional, nor
    ``mv(source, destination)``)."""
    readers = {}
    for spec in specs:
        parameters = spec["function"].get("parameters") or {}
        required = parameters.get("required") or []
        if len(required) == 1 and required[0] in READER_PARAMETERS:
            readers[spec["function"]["name"]] = required[0]
    return readers


class StepPolicy:
    """One run's steering, over its ``WorkingMemory`` and the tools it offers (OpenAI specs)."""

    def __init__(self, settings: StepPolicyConfig, memory: WorkingMemory, specs: list[dict]):
        self.settings = settings
        self.memory = memory
        self.specs = specs
        self.tools = [spec["function"]["name"] for spec in specs]
        self._mentions = mentions(self.tools)
        self.readers = _readers(specs)  # the tools that read a file, each with its path parameter
        self.language: str | None = None  # the task's, as the identifier or the model named it
        self._language_sent_back = False  # a reply in another language is sent back once (a translation stands)
        self.english: EnglishRules | None = None  # the English checks, where they apply to this run

    def begin(self) -> Generator[AskModel, Any, None]:
        """Before the first step: the task's language, when a setting needs it."""
        rules = self.settings.english_rules
        if self.settings.answer_language or rules == "english":
            self.language = language.identify(self.memory.goal, language.TASK)
            if self.language is None:  # a formula, a name, a word or two: the model names it
                reply = yield AskModel(LANGUAGE_QUESTION.format(text=self.memory.goal), LANGUAGE_SCHEMA)
                self.language = reply["language"] if reply else None
        if rules == "always" or (rules == "english" and self.language == "English"):
            self.english = EnglishRules(self.memory)

    def instruction(self) -> str:
        """What every step is told about the answer's language ("" when the language is not known)."""
        return f"Answer in {self.language}." if self.settings.answer_language and self.language else ""

    def note(self) -> str:
        """The working memory as the next step's prompt text, with what the task still needs."""
        english, memory = self.english, self.memory
        counting = bool(english and english.counting())
        extra = []
        if counting:  # else a small model writes Python for the calculator: sum(1 for line in ...)
            extra.append("Count with the numbered lines above; the calculator cannot count.")
        note = memory.note(english.related_memories() if english else memory.memories, self.to_read(""),
                           numbered=counting, extra=extra)
        return f"{note}\n{instruction}" if (instruction := self.instruction()) else note

    def to_read(self, answer: str) -> list[str]:
        """Unread files the answer cannot do without: those the task or ``answer`` names, and those a result names
        on the lines most about the task (``pointed_to``). None where the run has no tool that reads a file: a
        file a task names for other tools to act on (move it, copy it) is not there to be read."""
        if not self.settings.unread_files or not self.readers:
            return []
        return list(dict.fromkeys([*self.memory.unread(self.memory.goal, answer), *self.pointed_to()]))

    def pointed_to(self) -> list[str]:
        """Unread files a result names on the lines that share the most words with the task ("Plumber: details in
        people/plumber.txt" for "contacts.txt says where the plumber's details are"; not the other files an index
        lists): ``services.agent.topic``, in any language."""
        memory = self.memory
        pointers = [line for _, _, result in memory.facts for line in lines(result) if PATH.search(line)]
        about = topic.about(memory.goal, pointers)
        return memory.unread(*about) if about else []  # (no text: unread() would name every file)

    def first_choice(self) -> dict | None:
        """The tool a step is asked with before the model has what the task names: the reader while the task
        names a file not read yet (a small model otherwise reaches for another tool)."""
        return self.reader(unread) if (unread := self.to_read("")) else None

    def reader(self, paths: list[str]) -> dict | None:
        """The tool_choice that reads one of ``paths``: the reader an earlier call gave a path, else the first
        reader offered, else none (the model picks). The path is decoded under a schema that admits those
        paths only: a small model otherwise writes the path in other words ("notas/pan.md" as
        "notes/bread.md", "Lies notes/bread.md"), and reading what does not exist leads nowhere."""
        readers = self.readers
        used = [tool for tool, arguments, _ in self.memory.facts if tool in readers
                and PATH.search(str(_arguments(arguments).get(readers[tool]) or ""))]
        tool = used[0] if used else next(iter(readers), None)
        return named(tool, self._holding(tool, readers[tool], paths)) if tool else None

    def _holding(self, tool: str, parameter: str, paths: list[str]) -> dict | None:
        """``tool``'s parameters with ``parameter`` held to ``paths``."""
        spec = next(s["function"] for s in self.specs if s["function"]["name"] == tool)
        parameters = spec.get("parameters") or {"type": "object", "properties": {}}
        if parameters.get("properties", {}).get(parameter, {}).get("type", "string") != "string":
            return None  # a caller's tool that takes its path otherwise: its own schema
        return {**parameters, "properties": {**parameters.get("properties", {}),
                                             parameter: {"type": "string", "enum": paths}}}

    def intended_tool(self, text: str) -> str | None:
        """The tool a reply names in prose instead of calling it."""
        found = self._mentions.search(text)
        return self.tools[int(found.lastgroup[1:])] if found else None

    def computed(self, tool: str, arguments: dict) -> Computed | None:
        """A calculator call that names columns of the tables the run has read, computed over their values
        (None: it names none, and the tool computes it)."""
        expression = arguments.get("expression")
        if not self.settings.named_facts or tool != COMPUTE_TOOL or not isinstance(expression, str):
            return None
        named_facts: dict[str, list[float]] = {}
        for _, _, result in self.memory.facts:
            named_facts.update(tables.columns(result))  # a later read of a table wins
        if not any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", expression) for name in named_facts):
            return None
        try:
            return Computed(output=str(evaluate(expression, named_facts)))
        except (SyntaxError, ValueError, ArithmeticError, TypeError) as exc:
            return Computed(error=f"tool_failed: {type(exc).__name__}: {exc}")

    def answer_now(self) -> bool:
        """After a step's tool results: whether the next step must answer (what to count is read, so the count
        is read off the note's numbered lines; a small model writes Python for the calculator instead)."""
        return bool(self.english and self.english.counting()) and not self.to_read("")

    def review(self, answer: str) -> Generator[AskModel, Any, Verdict]:
        """Whether the candidate ``answer`` stands, and if not why and which tool the next step is asked with."""
        unread = self.to_read(answer)
        english = self.english
        reasons = [f"{path} has not been read yet" for path in unread] + (
            english.unmet(answer) if english else self._unbacked(answer))
        if unread:
            return Verdict(reasons, self.reader(unread))
        if planned := self._planned(answer):
            return Verdict([f"it says to use {planned} instead of calling it"], named(planned),
                           then=f"Call {planned} now.")
        if reasons:
            if COMPUTE_TOOL in self.tools and english and english.wrong_units(answer):
                return Verdict(reasons, named(COMPUTE_TOOL))
            # an answer with figures nothing backs (a formula, a guess) is told to compute with a tool: it is asked
            # with one, the tool it names, else the calculator (asked freely, a small model writes the formula again)
            invents = bool(self._invented(answer)) and not (english and english.counting())
            choice = self._tool_in(answer) or (named(COMPUTE_TOOL) if invents and COMPUTE_TOOL in self.tools else None)
            return Verdict(reasons, choice)
        if written := self._other_language(answer):
            return Verdict([f"the reply is in {written}, not in {self.language}"],
                           then=f"Reply with the answer now, in {self.language}.")
        if self.settings.judge:
            language = f", written in {self.language}" if self.settings.answer_language and self.language else ""
            judged = yield AskModel(JUDGE_QUESTION.format(language=language), JUDGE_SCHEMA, about=answer)
            if judged and not judged["final_answer"]:
                missing = judged["missing"].strip() or "it is not the final answer yet"
                return Verdict([missing], self._tool_in(answer))
        return Verdict()

    def _other_language(self, answer: str) -> str | None:
        """The language ``answer`` is surely written in where that is not the task's, the first time only (None:
        the same, unsure, or sent back once already: "Say good morning in Spanish" is answered in Spanish)."""
        if not (self.settings.answer_language and self.language) or self._language_sent_back:
            return None
        written = language.identify(answer, language.ANSWER)
        if written is None or written == self.language:
            return None
        self._language_sent_back = True
        return written

    def _invented(self, answer: str) -> list[str]:
        """The figures of ``answer`` nothing the run knows backs, by the checks that apply: the English rules'
        (with their units), else every reading of the numbers (only once a tool ran or the task has numbers: "a
        spider has 8 legs" needs no source)."""
        memory = self.memory
        if self.english:
            return self.english.invented(answer)
        if not self.settings.figures or not (memory.facts or figures.values(memory.goal)):
            return []
        listed = max((len(lines(result)) for _, _, result in memory.facts), default=0)
        return figures.unbacked(answer, self._sources(), listed)

    def _unbacked(self, answer: str) -> list[str]:
        """Why ``answer``'s figures do not stand, where the English rules do not check them."""
        if invented := self._invented(answer):
            was = "was" if len(invented) == 1 else "were"
            return [f"{', '.join(invented)} {was} not read or computed with a tool; compute with a tool"]
        return []

    def _sources(self) -> list[str]:
        """What backs a figure: the task, the recalled memories, every tool result."""
        return [self.memory.goal, *self.memory.memories, *(result for _, _, result in self.memory.facts)]

    def _planned(self, answer: str) -> str | None:
        """Once tools have run, the first tool ``answer`` names that no call of the run used: the reply plans the
        next step in prose ("You can do this using the `mkdir` function") instead of taking it. (A tool it names
        that has run is a report of what was done.)"""
        if not self.settings.plans or not self.memory.facts:
            return None
        called = {tool for tool, _, _ in self.memory.facts}
        named_tools = (self.tools[int(found.lastgroup[1:])] for found in self._mentions.finditer(answer))
        return next((tool for tool in named_tools if tool not in called), None)

    def _tool_in(self, answer: str) -> dict | None:
        """A plan in prose sent back: the tool it means to use."""
        tool = self.intended_tool(answer)
        return named(tool) if tool else None
