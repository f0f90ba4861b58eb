"""The agent benchmark's corpus: task sets as data files (``data/agent_<set>.json``), each with the files it
writes for ``file_reader`` and the memories it stores for ``memory_search``.

Kept as data so a set written for measuring is never edited alongside the agent's code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
KINDS = ("arithmetic", "file", "memory", "two_tools", "multi_step", "no_tool", "mcp")


@dataclass(frozen=True)
class Task:
    kind: str  # one of KINDS
    goal: str
    expected: tuple[str, ...]  # every item must be in the answer; "a|b": either
    language: str = "en"  # the question's language: how the grader reads the answer's numbers
    set: str = "tune"  # the task set it comes from (data/agent_<set>.json)


def load_set(name: str) -> tuple[list[Task], dict[str, str], list[str]]:
    """A task set: its tasks, the files it writes, the memories it stores. A file's "set" names the set its
    tasks report under, so agent_test_de.json counts as test/de beside test/en."""
    data = json.loads((DATA / f"agent_{name}.json").read_text(encoding="utf-8"))
    tasks = [Task(t["kind"], t["goal"], tuple(t["expected"]), t.get("language", data.get("language", "en")),
                  data.get("set", name)) for t in data["tasks"]]
    return tasks, data.get("files", {}), data.get("memories", [])


def available_sets() -> list[str]:
    return sorted(p.stem.removeprefix("agent_") for p in DATA.glob("agent_*.json"))


def load_sets(names: list[str], kinds: list[str] | None = None,
              limit: int | None = None) -> tuple[list[Task], dict[str, str], list[str]]:
    """Several sets in one run (of each, the tasks of ``kinds``, the first ``limit`` of them): their files and
    memories together, a file two sets write differently being an error rather than a silent overwrite."""
    tasks, files, memories = [], {}, []
    for name in names:
        set_tasks, set_files, set_memories = load_set(name)
        tasks += [t for t in set_tasks if kinds is None or t.kind in kinds][:limit]
        for path, text in set_files.items():
            if files.setdefault(path, text) != text:
                raise SystemExit(f"sets {', '.join(names)}: {path} has two different contents")
        memories += [m for m in set_memories if m not in memories]
    return tasks, files, memories


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


#: The tune set: the tasks the agent's steering was developed on.
TASKS, FILES, MEMORIES = load_set("tune")
