"""The three systems a BFCL case runs through, turn by turn, each call executed on the case's simulated APIs
(``official.Session``) and recorded per turn and model step for the official checker:

``responses``  Magnitude's gateway ``POST /v1/responses``, the case's functions as the caller's tools: each
               ``function_call`` the gateway hands out is run and posted back as a ``function_call_output``
               with ``previous_response_id``, until the run answers; a later turn goes on from the turn's last
               response (``previous_response_id`` of a finished response: the conversation, its warm session).
``chat``       the loop a user writes with the official ``openai`` client against the gateway's
               ``/v1/chat/completions``: messages and tools, run the returned tool calls, append tool messages,
               until a reply without calls.
``peer``       the same loop against llama-server.

No system prompt is added to the chat loops: BFCL's function-calling runs send the case's messages and tools
only. ``/v1/responses`` is Magnitude's agent, with its own system prompt and step policy: that is what is
measured. A run that fails (an HTTP error, a timeout) ends that case, recorded; the bench goes on.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from scripts.bench.bfcl.official import Case, Session, check, response_tool, tool_spec, turns_passed

SYSTEMS = ("responses", "chat", "peer")


@dataclass
class Record:
    case: str
    system: str
    turns: list[list[list[str]]] = field(default_factory=list)  # per turn, per model step, its call strings
    answers: list[str | None] = field(default_factory=list)  # per turn, the model's last text
    steps: int = 0  # model steps (requests that returned a reply), all turns
    refused: int = 0  # calls not run: a name none of the case's functions has, arguments that are no object
    seconds: float = 0.0
    error: str | None = None  # why the case stopped early
    notes: list[str] = field(default_factory=list)
    verdict: dict = field(default_factory=dict)  # the official checker's
    turns_ok: int = 0  # leading turns the official checker passes
    n_turns: int = 0  # the case's turns

    @property
    def ok(self) -> bool:
        return bool(self.verdict.get("valid"))

    def to_dict(self) -> dict:
        verdict = {k: v for k, v in self.verdict.items() if k in ("valid", "error_type", "error_message")}
        return {"case": self.case, "system": self.system, "ok": self.ok, "verdict": verdict,
                "turns_ok": self.turns_ok, "turns": self.n_turns, "seconds": round(self.seconds, 2),
                "steps": self.steps, "refused": self.refused, "error": self.error, "notes": self.notes,
                "calls": self.turns, "answers": self.answers}

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        """A record as ``to_dict`` wrote it, unscored (``--rescore``)."""
        return cls(d["case"], d["system"], turns=d["calls"], answers=d["answers"], steps=d["steps"],
                   refused=d["refused"], seconds=d["seconds"], error=d["error"], notes=d["notes"])


def _arguments(text: str | None) -> Any:
    try:
        return json.loads(text or "{}")
    except (TypeError, ValueError):
        return None


def _run_call(session: Session, record: Record, step: list[str], name: str, arguments: str | None) -> str:
    call, output = session.run(name, _arguments(arguments))
    if call is None:
        record.refused += 1
    else:
        step.append(call)
    return output


def _user_text(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages if m.get("role") == "user")


# --- responses ------------------------------------------------------------------------------------------
class ResponsesClient:
    """``POST /v1/responses`` with urllib, as software in any language would call it."""

    def __init__(self, url: str, key: str | None, timeout_s: float):
        self.url, self.key, self.timeout_s = url, key, timeout_s

    def post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(f"{self.url}/v1/responses", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {err.code}: {detail}") from None


def run_responses(client: ResponsesClient, case: Case, max_calls: int) -> Record:
    """One case over ``/v1/responses``; ``max_calls``: the caller's calls one turn may make (the model steps
    of a run are capped by the gateway's ``agent.max_iterations``)."""
    record, session = Record(case.id, "responses"), Session(case, "responses")
    tools = [response_tool(tool_spec(f)) for f in case.functions]
    previous = None
    with _recorded(record, session):
        for turn in case.turns:
            steps: dict[int, list[str]] = {}
            body: dict = {"input": _user_text(turn), "tools": tools}
            if previous is not None:
                body["previous_response_id"] = previous
            response, calls, seen = client.post(body), 0, set()
            while True:
                for item in response["output"]:
                    seen.add(item.get("step"))
                if response["status"] != "requires_action":
                    break
                pending = [i for i in response["output"] if i["type"] == "function_call"]  # the step's calls
                calls += len(pending)
                if calls > max_calls:
                    record.notes.append(f"turn {len(record.turns)}: stopped after {max_calls} calls")
                    # the run waits for these outputs; it is dropped after gateway.agent_wait_s
                    response = {"id": None, "status": "stopped", "output": []}
                    break
                outputs = [{"type": "function_call_output", "call_id": call["call_id"],
                            "output": _run_call(session, record, steps.setdefault(call.get("step", 0), []),
                                                call["name"], call.get("arguments"))} for call in pending]
                response = client.post({"previous_response_id": response["id"], "input": outputs})
            record.steps += len(seen - {None})
            texts = [i["content"][0]["text"] for i in response["output"] if i["type"] == "message" and i["content"]]
            record.answers.append(texts[-1] if texts else None)
            record.turns.append([steps[k] for k in sorted(steps)])
            if response["status"] == "failed":
                record.notes.append(f"turn {len(record.turns) - 1}: failed: {response.get('error')}")
            if response["status"] not in ("completed", "incomplete"):
                # nothing finished to go on from: the case cannot continue as one conversation
                record.error = f"turn {len(record.turns) - 1} ended {response['status']}"
                break
            previous = response["id"]
    return record


# --- the plain chat-completions loop -------------------------------------------------------------------------
def run_chat(client: Any, system: str, model: str, case: Case, max_steps: int, max_tokens: int,
             extra_headers: dict | None = None) -> Record:
    """One case through the loop a user writes with the official ``openai`` client: ``max_steps`` replies per
    turn at most (then the next turn's message follows, as the user's next message would)."""
    record, session = Record(case.id, system), Session(case, system)
    tools = [tool_spec(f) for f in case.functions]
    messages: list[dict] = []
    with _recorded(record, session):
        for index, turn in enumerate(case.turns):
            messages += [{"role": m["role"], "content": m["content"]} for m in turn]
            steps: list[list[str]] = []
            answer = None
            for _ in range(max_steps):
                reply = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                                       seed=0, max_tokens=max_tokens, extra_headers=extra_headers)
                record.steps += 1
                message = reply.choices[0].message
                answer = message.content
                if not message.tool_calls:
                    messages.append({"role": "assistant", "content": message.content or ""})
                    break
                messages.append(message.model_dump(exclude_none=True))
                step: list[str] = []
                for call in message.tool_calls:
                    output = _run_call(session, record, step, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
                steps.append(step)
            else:
                record.notes.append(f"turn {index}: {max_steps} steps, still calling")
            record.turns.append(steps)
            record.answers.append(answer)
    return record


@contextmanager
def _recorded(record: Record, session: Session) -> Iterator[None]:
    """One case's run: its time into ``record``, a failure (the server refused or failed) as its error, the bench
    going on; the case's simulated APIs closed."""
    t0 = time.monotonic()
    try:
        yield
    except Exception as err:  # this case failed, the bench goes on
        record.error = f"{type(err).__name__}: {err}"[:400]
    finally:
        session.close()
        record.seconds = time.monotonic() - t0


def score(case: Case, record: Record) -> Record:
    record.n_turns = len(case.ground_truth)
    try:
        record.verdict = check(case, record.turns)
        record.turns_ok = record.n_turns if record.ok else turns_passed(case, record.turns)
    except Exception as err:  # the checker itself failed on what the model did: a failed case, said why
        record.verdict = {"valid": False, "error_type": "checker_exception", "error_message": f"{err}"[:300]}
    return record


def progress(i: int, n: int, record: Record) -> None:
    mark = "ok  " if record.ok else "FAIL"
    calls = sum(len(s) for t in record.turns for s in t)
    why = record.error or ("" if record.ok else record.verdict.get("error_type", ""))
    print(f"  [{record.system} {i}/{n}] {mark} {record.case:<20} {record.seconds:6.1f}s {record.steps:3d} steps "
          f"{calls:3d} calls, turns passed {record.turns_ok}/{record.n_turns}  {why}", file=sys.stderr, flush=True)
