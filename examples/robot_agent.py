#!/usr/bin/env python3
"""A robot's task loop on Magnitude: plan (streamed), act (agent + tool), report the outcome.

Run it against the stack of `magnitude up` (endpoints come from the same config)::

    .venv/bin/magnitude up
    .venv/bin/python examples/robot_agent.py                # the built-in tasks
    .venv/bin/python examples/robot_agent.py --task "Carry 4 boxes of 12 kg: how many kg in all?"

Each task is one session (an unguessable id):
  1. plan:   a short plan, streamed token by token and printed as it comes;
  2. act:    an AsyncAgent run that calls a tool (the calculator is configured by default);
  3. report: success or failure goes to the optimizer as feedback.

Every request is retried with the same request id on transient failures (the service restarted,
its queue was full), and the services deduplicate retries by (session, id). So a restart of the
chat service mid-task costs a retry, not the task; a plan whose stream restarts is printed again.
A service that stays down longer than --deadline ends the run with exit code 1.
Plan and answers go to stdout; what happened (retries, outcomes) as JSON log lines to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout too

from magnitude.agent import AsyncAgent, Trace  # noqa: E402
from magnitude import RETRYABLE, AsyncClient, GenerateResult, Restart, Retry, ServiceError, Stats  # noqa: E402
from shared.config import ConfigError, load_config  # noqa: E402
from shared.logs import configure_logging  # noqa: E402

TASKS = [
    "The robot carries 3 boxes of 14 kg each to the garage. How many kg is that in total?",
    "The kitchen floor is 7 m long and 4 m wide. How many square metres must the robot mop?",
]

log = configure_logging("robot_agent")


async def plan(inference: AsyncClient, task: str, session: str, retry: Retry, max_tokens: int) -> str:
    """Stream a short plan, printing tokens as they come; a restarted stream is printed anew."""
    prompt = f"Robot task: {task}\nStep-by-step plan for the robot:\n1."  # the model continues text
    print("plan> 1.", end="", flush=True)
    result, restarts = GenerateResult(text="", stats=Stats()), 0
    async for piece in inference.generate_stream(prompt, session, retry=retry, max_tokens=max_tokens,
                                                 stop=["\n\n"], temperature=0):
        if isinstance(piece, Restart):  # the service went away mid-stream: what we printed is void
            restarts += 1
            print(f"\n[stream restarted: {piece.code}]\nplan> 1.", end="", flush=True)
        elif isinstance(piece, str):
            print(piece, end="", flush=True)
        else:
            result = piece
    print()
    log.info("plan_done", session=session, restarts=restarts, ttft_s=result.stats.ttft_s,
             tokens=result.stats.completion_tokens)
    return result.text


def outcome(trace: Trace) -> tuple[bool, str | None]:
    """Success means a final answer reached with at least one tool call that worked."""
    used_tool = any(call.error is None for step in trace.steps for call in step.calls)
    if trace.stopped != "final_answer":
        return False, trace.error or trace.stopped
    return (True, None) if used_tool else (False, "answered without a tool")


async def run_task(number: int, task: str, inference: AsyncClient, agent: AsyncAgent, optimizer: AsyncClient,
                   retry: Retry, args: argparse.Namespace) -> None:
    session = f"robot-{uuid.uuid4().hex}"
    print(f"\n=== task {number}: {task}", flush=True)
    log.info("task_started", task=number, session=session)
    await plan(inference, task, session, retry, args.plan_tokens)
    trace = await agent.run(task, session_id=session, max_iterations=args.max_iterations)
    if trace.stopped == "error" and trace.error.split(":", 1)[0] in RETRYABLE:  # trace.error is "code: message"
        raise ServiceError(*trace.error.split(": ", 1))  # inference still down after every retry: give up
    for step in trace.steps:
        for call in step.calls:
            print(f"act>  {call.name}({call.arguments}) -> {call.error or call.output}", flush=True)
    success, reason = outcome(trace)
    print(f"done> {'success' if success else 'failure'}: {trace.answer if success else reason}", flush=True)
    ack = await optimizer.request("feedback", {"session_id": session, "success": success, "error_reason": reason,
                                               "details": {"task": task, "steps": len(trace.steps)}},
                                  session_id=session, retry=retry)
    log.info("feedback_stored", task=number, success=success, feedback_id=ack["id"])


async def main(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    retry = Retry(deadline_s=args.deadline, on_retry=lambda r: log.warning(
        "retrying", attempt=r.attempt, code=r.code, error=r.message, delay_s=r.delay_s))
    inference = AsyncClient.for_service("inference", config, timeout_s=args.timeout)
    optimizer = AsyncClient.for_service("optimizer", config, timeout_s=args.timeout)
    agent = AsyncAgent(config, timeout_s=args.timeout, retry=retry)
    tasks = args.task or TASKS
    try:
        for number, task in enumerate(tasks, 1):
            await run_task(number, task, inference, agent, optimizer, retry, args)
    except ServiceError as err:
        log.error("giving_up", code=err.code, error=err.message)
        hint = f" (down for over --deadline {args.deadline:g}s; is the stack up?)" if err.code in RETRYABLE else ""
        print(f"robot_agent: giving up: {err}{hint}", file=sys.stderr)
        return 1
    finally:
        for client in (inference, optimizer, agent):
            client.close()
    log.info("all_tasks_done", tasks=len(tasks))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="Magnitude YAML config (default: $MAGNITUDE_CONFIG or built-in defaults)")
    parser.add_argument("--task", action="append", help="a task to run (repeatable; default: the built-in tasks)")
    parser.add_argument("--plan-tokens", type=int, default=48, help="max tokens of each streamed plan (default 48)")
    parser.add_argument("--max-iterations", type=int, default=3, help="agent steps per task (default 3)")
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="seconds a service may stay unreachable before the run gives up (default 60)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each reply (default 120)")
    args = parser.parse_args(argv)
    if min(args.plan_tokens, args.max_iterations, args.deadline, args.timeout) <= 0:
        parser.error("--plan-tokens, --max-iterations, --deadline and --timeout must be positive")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    try:
        sys.exit(asyncio.run(main(arguments)))
    except ConfigError as err:
        sys.exit(f"robot_agent: {err}")
