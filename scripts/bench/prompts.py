"""The benchmarks' agent text: Gemma 3 turn markup for raw ``generate`` prompts on the small base model, and a
household robot planner's conversation for the benchmarks that step agents.

Agents and ``magnitude generate --chat`` use the ``chat`` message instead, which renders each model's own
template. Keeping a conversation as one growing string is what lets a session reuse its KV from one step to
the next.
"""

from __future__ import annotations

#: A planner agent's system prompt (a household robot's) and tasks.
PLANNER_SYSTEM = (
    "You are the task planner of a household robot. You can use these tools: "
    "move_to(room) moves the robot to a room; pick(object) picks up an object that is in reach; "
    "place(object, location) puts a held object down; open(container) opens a door, drawer or fridge; "
    "say(text) speaks to the user; look() describes what the camera sees; wait(seconds) pauses. "
    "Rules: plan one step at a time, check the result of every step before the next, never hold more "
    "than one object, keep the user informed, and stop when the task is complete. The house has a "
    "kitchen, a living room, a bedroom, a bathroom and a hallway. The user is in the living room. "
)
PLANNER_TASKS = ["bring a glass of water", "find the red book", "water the plants", "close every window",
                 "charge the vacuum", "fold the towels", "feed the cat", "check the front door"]


def gemma_turn(role: str, text: str) -> str:
    """One turn; ``role`` is ``user`` or ``model`` (Gemma has no system role: fold it into the first user turn)."""
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def gemma_prompt(turns: list[tuple[str, str]]) -> str:
    """The whole conversation, ending with an open model turn for the reply."""
    return "".join(gemma_turn(role, text) for role, text in turns) + "<start_of_turn>model\n"


def agent_history(agent: int) -> list[tuple[str, str]]:
    """A planner agent's first turn: the system prompt (three times: a long shared prefix) and its task."""
    return [("user", f"{PLANNER_SYSTEM * 3}\nTask: {PLANNER_TASKS[agent % len(PLANNER_TASKS)]}.")]


def next_turn(history: list[tuple[str, str]], step: int) -> list[tuple[str, str]]:
    """The conversation with the observation of step ``step`` added (the model's reply is already in it)."""
    return history + [("user", f"Step {step} done: the robot reports success. Continue.")]
