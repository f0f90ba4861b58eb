"""The tool service: ``tool.list`` and ``tool.call`` over the configured tools (``agent.tools``).

Arguments are validated against each tool's JSON schema before anything runs;
built-ins run in-process, python/shell tools in ``sandbox.run`` confined by a
``jail.Jail`` (bubblewrap where it works), MCP servers' tools through ``mcp_client.McpHub``
(their stdio servers confined by the same jail). Every failure is a typed
``tool_failed`` / ``bad_request`` / ``not_found`` reply and the service keeps
serving; several calls run at once on the worker threads.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from services.tools import builtins, sandbox
from services.tools.mcp_client import McpHub, McpTool, offered_names
from services.tools.errors import tool_failed
from services.tools.jail import Jail
from shared import shm
from shared.config import Config, SandboxLimits, ToolConfig
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.security import session_ref
from shared.service import Emitter, Service
from shared.text import cap_text


@dataclass
class _Tool:
    config: ToolConfig
    description: str
    schema: dict[str, Any]
    validator: jsonschema.Draft202012Validator
    limits: SandboxLimits

    def describe(self) -> dict[str, Any]:
        return {"name": self.config.name, "kind": self.config.kind, "description": self.description,
                "parameters": self.schema}


def shell_argv(template: str, args: dict[str, Any]) -> list[str]:
    """The command's argv with each ``{name}`` filled in.

    No shell parses the values, so they cannot inject commands; and a value may not turn a token into an
    option (``--delete``, ``-rf``) unless the template ends the options with ``--`` before it, so they cannot
    inject options either. Tokens the template itself starts with ``-`` (``--name={name}``) are options by
    design and take any value.
    """
    argv, options_end = [], False
    try:
        for token in shlex.split(template):
            filled = token.format_map(args)
            if not options_end and filled.startswith("-") and not token.startswith("-"):
                raise tool_failed("refused", f"argument {filled[:40]!r} would be read as an option; the tool's "
                                             "template must put -- before it to accept such values")
            options_end = options_end or token == "--"
            argv.append(filled)
    except (KeyError, IndexError, ValueError) as exc:
        raise tool_failed("refused", f"command template {template!r} cannot be filled: {exc!r}")
    return argv


def python_target(target: str) -> tuple[str, list[Path]]:
    """A python tool's target with a ``file.py`` made absolute (against the service's working directory, once:
    the child runs elsewhere), and the folder it imports its neighbours from."""
    module, function = target.rsplit(":", 1)
    if not module.endswith(".py"):
        return target, []
    path = Path(os.path.abspath(module))
    return f"{path}:{function}", [path.parent]


class ToolService(Service):
    name = "tools"
    worker_threads = 4

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.jail = Jail(config)
        self.tools: dict[str, _Tool] = {}
        for tc in config.agent.tools:
            schema = tc.parameters or builtins.SCHEMAS[tc.name]
            self.tools[tc.name] = _Tool(tc, tc.description or builtins.DESCRIPTIONS.get(tc.name, ""), schema,
                                        jsonschema.Draft202012Validator(schema), config.agent.limits_for(tc))
        self.mcp = McpHub(config.agent.mcp_servers, {s.name: config.agent.mcp_limits(s)
                                                     for s in config.agent.mcp_servers}, self.jail, self.log)
        self.handle("tool.list", self._list)
        self.handle("tool.call", self._call)

    def worker_stall_s(self) -> float:
        """A tool may legitimately run until its own timeout."""
        limits = [t.limits for t in self.tools.values()] + [s.limits for s in self.mcp.servers.values()]
        return max(super().worker_stall_s(), max((x.timeout_s for x in limits), default=0.0) + 10.0)

    def health_details(self) -> dict[str, Any]:
        return {"tools": [*self.tools, *self._mcp_tools()], "tool_isolation": self.jail.describe(),
                **({"mcp": self.mcp.status()} if self.mcp.servers else {})}

    def _mcp_tools(self) -> dict[str, McpTool]:
        """The MCP servers' tools by the name they are offered under."""
        return offered_names(set(self.tools), self.mcp.tools())

    def run(self) -> None:
        described = self.jail.describe()
        if self.jail.namespaced:
            self.log.info("tool_isolation", **described)
        else:
            self.log.warning("tool_isolation", **described,
                             consequence="tools see the whole filesystem and the network, and a tool that "
                                         "double-forks can outlive its kill (see docs/security.md)")
        self.mcp.start(max((s.connect_timeout_s for s in self.config.agent.mcp_servers), default=0.0))
        super().run()

    def close(self) -> None:
        self.mcp.close()

    def _list(self, req: Request, emit: Emitter) -> dict:
        return {"tools": [t.describe() for t in self.tools.values()]
                + [{"name": name, "kind": "mcp", "server": tool.server, "description": tool.description,
                    "parameters": tool.schema, "available": self.mcp.available(tool)}
                   for name, tool in self._mcp_tools().items()]}

    def _call(self, req: Request, emit: Emitter) -> dict:
        name, args = req.body["tool"], req.body["args"]
        tool = self.tools.get(name)
        mcp_tool = None if tool else self._mcp_tools().get(name)
        if tool is None and mcp_tool is None:
            names = [*self.tools, *self._mcp_tools()]
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no tool {name!r} (tools: {', '.join(names)})")
        validator = tool.validator if tool else mcp_tool.validator
        error = validator and jsonschema.exceptions.best_match(validator.iter_errors(args))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "args"
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} {where}: {error.message}")
        started = time.monotonic()
        try:
            if tool:
                output, truncated = self._run(tool, args)
            else:
                output, truncated = cap_text(self.mcp.call(mcp_tool, args),
                                             self.mcp.servers[mcp_tool.server].limits.max_output_bytes)
        except ProtocolError as err:
            self.log.warning("tool_failed", tool=name, session=session_ref(req.session), error=err.message,
                             ms=round((time.monotonic() - started) * 1000, 1))
            raise
        elapsed_ms = round((time.monotonic() - started) * 1000, 1)
        self.log.info("tool_call", tool=name, session=session_ref(req.session), ms=elapsed_ms, bytes=len(output),
                      truncated=truncated)
        reply: dict[str, Any] = {"tool": name, "truncated": truncated, "elapsed_ms": elapsed_ms}
        encoded = output.encode()
        if len(encoded) > shm.INLINE_LIMIT_BYTES:
            reply["output_shm"] = shm.put_bytes(encoded, self.shm_pool)
        else:
            reply["output"] = output
        return reply

    def _run(self, tool: _Tool, args: dict[str, Any]) -> tuple[str, bool]:
        tc = tool.config
        if tc.kind == "builtin":
            return cap_text(builtins.run_builtin(tc.name, args, self.config), tool.limits.max_output_bytes)
        roots = [Path(os.path.abspath(r)) for r in tc.roots]
        if tc.kind == "python":
            target, folder = python_target(tc.target)
            call = sandbox.Call({"python": target}, tool.limits, roots + folder, tc.network,
                                python_path=[str(p) for p in roots + folder] + _service_import_path())
        else:
            call = sandbox.Call({"argv": shell_argv(tc.target, args)}, tool.limits, roots, tc.network)
        outcome = sandbox.run(call, args, self.jail)
        return outcome.output, outcome.truncated


def _service_import_path() -> list[str]:
    """What the service itself imports from beyond the interpreter's own: its PYTHONPATH."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
