"""``magnitude``: start, stop, check and try the stack from a shell."""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec

from magnitude import agent_cli, fleet_cli, launcher, mcp_cli, memory_cli, models_cli, stats_cli, strategy_cli
from shared import health as healthcheck
from shared import process
from shared.client import ChatResult, Client, GenerateResult, ServiceError
from shared.config import SERVICE_NAMES, ConfigError, dump_config, load_config
from shared.health import print_statuses


def cmd_up(args, config) -> int:
    statuses = launcher.up(config, args.config)
    return print_statuses(statuses, False)


def cmd_down(args, config) -> int:
    for name, outcome in launcher.down(config).items():
        print(f"{name:<12} {outcome}")
    return 0


def cmd_health(args, config) -> int:
    return print_statuses(launcher.health(config, args.service, args.timeout), args.json)


def _stream_to_stdout(client: Client, prompt: str, session_id: str | None, **params) -> GenerateResult:
    result = None
    for piece in client.generate_stream(prompt, session_id, **params):
        if isinstance(piece, GenerateResult):
            result = piece
        else:
            assert isinstance(piece, str)  # no retry is given, so no Restart comes
            sys.stdout.write(piece)
            sys.stdout.flush()
    print()
    return result


def _stream_chat_to_stdout(client: Client, text: str, session_id: str | None, **params) -> dict:
    """One user turn through the model's own chat template (``Client.chat_stream``); the final stats."""
    stats: dict = {}
    for piece in client.chat_stream([{"role": "user", "content": text}], session_id, **params):
        if isinstance(piece, ChatResult):
            stats = {"finish_reason": piece.finish_reason, **msgspec.structs.asdict(piece.stats)}
        elif isinstance(piece, str):
            sys.stdout.write(piece)
            sys.stdout.flush()
    print()
    return stats


def cmd_generate(args, config) -> int:
    client = Client.for_service("inference", config, timeout_s=args.timeout)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stop": args.stop or None}
    try:
        if args.chat:
            stats = _stream_chat_to_stdout(client, args.prompt, args.session, **params)
        else:
            stats = msgspec.structs.asdict(_stream_to_stdout(client, args.prompt, args.session, **params).stats)
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(stats), file=sys.stderr)
    return 0


def cmd_demo(args, config) -> int:
    """Start the stack; stream two steps of one session (the second reuses the first's KV);
    then run one agent task that needs the calculator tool, and print its trace."""
    from magnitude.agent import Agent

    started_here = any(process.read_pid(config, n) is None for n in SERVICE_NAMES)
    if print_statuses(launcher.up(config, args.config), False) != 0:
        return 1
    client = Client.for_service("inference", config, timeout_s=120)
    session = f"demo-{int(time.time())}"
    # Raw completion (no chat template): the session is a growing robot log, each step adds to it.
    log = "Household robot log.\n08:00 Charged the battery to 100%.\n08:15 Vacuumed the living room.\n08:30"
    agent = Agent(config, timeout_s=120)
    try:
        for step, (stop, next_entry) in enumerate((("\n09", "\n09:00 The family asked for breakfast.\n09:05"),
                                                   ("\n10", "")), start=1):
            print(f"\n--- session step {step} (session {session}) ---\n{log}", end="")
            result = _stream_to_stdout(client, log, session, max_tokens=40, temperature=0, stop=[stop])
            s = result.stats
            print(f"[prompt={s.prompt_tokens} cached={s.cached_tokens} prefill={s.prefill_tokens} "
                  f"ttft={s.ttft_s}s decode={s.decode_tps} tok/s]")
            log += result.text + next_entry
        print("\n--- agent task: magnitude run 'What is 23 * 47?' ---")
        agent_cli.print_trace(agent.run("What is 23 * 47?"))
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        agent.close()
        client.close()
        if started_here and not args.keep:
            cmd_down(args, config)
    return 0


def cmd_config(args, config) -> int:
    print(dump_config(config), end="")
    return 0


#: Feature areas add their subcommands here: each is ``register(subparsers)``, setting ``fn(args, config)``.
_COMMAND_GROUPS: list = [memory_cli.register, agent_cli.register, stats_cli.register, strategy_cli.register,
                         models_cli.register, mcp_cli.register, fleet_cli.register]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="magnitude",
        description="Magnitude: on-device inference for agents. Services run as local processes "
                    "(logs and sockets in runtime.run_dir, default ~/.cache/magnitude/run).")
    parser.add_argument("--config", help="YAML config (default: $MAGNITUDE_CONFIG, else built-in defaults)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start every service (then the watchdog) and wait until healthy").set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the watchdog, then every service (drains in-flight requests)").set_defaults(fn=cmd_down)
    p = sub.add_parser("health", help="check every service; exit 1 if any is unhealthy")
    healthcheck.add_arguments(p)
    p.set_defaults(fn=cmd_health)
    p = sub.add_parser("generate", help="stream a completion from the inference service")
    p.add_argument("prompt")
    p.add_argument("--session", help="session id: reuse its KV cache across calls")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn, rendered with the model's own chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("demo", help="start the stack, stream a two-step session and run an agent task on the real model")
    p.add_argument("--keep", action="store_true", help="leave the services running afterwards")
    p.set_defaults(fn=cmd_demo)
    sub.add_parser("config", help="print the effective configuration (validates the file)").set_defaults(fn=cmd_config)
    for register in _COMMAND_GROUPS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return args.fn(args, config)


if __name__ == "__main__":
    sys.exit(main())
