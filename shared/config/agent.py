"""The ``agent`` section: tools (built-in, python, shell), their sandbox limits, and the agent loop's bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from shared.config.base import Section, error_lines
from shared.config.mcp import MCP_CPU_S, McpServerConfig

#: Tools the tool service implements itself (``kind: builtin``).
BUILTIN_TOOLS = ("calculator", "file_reader", "memory_search")
#: The action name that ends an agent run; no tool may take it.
FINAL_ANSWER = "final_answer"


class SandboxLimits(Section):
    """What one python/shell tool call may use; enforced with rlimits and a wall-clock kill of everything it started."""

    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall clock, then the process group is killed")
    cpu_s: int = Field(10, ge=1, le=3600, description="RLIMIT_CPU")
    memory_mb: int = Field(512, ge=32, le=1 << 20, description="RLIMIT_AS (address space)")
    max_output_bytes: int = Field(16384, ge=256, le=16 << 20, description="output kept; the rest is cut with a note")
    max_file_mb: int = Field(16, ge=0, le=1 << 20, description="RLIMIT_FSIZE: largest file a tool may write")
    max_processes: int = Field(16, ge=0, le=4096, description="RLIMIT_NPROC head-room over the processes the "
                                                              "tools' uid already runs")


class StepPolicyConfig(Section):
    """Which checks steer a run of the agent loop (``services/agent/policy.py``; measured in docs/agents.md)."""

    answer_language: bool = Field(True, description="the task's language is named before the first step (by a "
                                                    "statistical identifier; by the model where that is unsure), "
                                                    "each step is told to answer in it, and a candidate answer "
                                                    "surely in another language is sent back once")
    judge: bool = Field(True, description="the model judges a candidate answer against the task and what was "
                                          "found (a yes/no under a JSON schema, in the run's session) before it "
                                          "stands")
    unread_files: bool = Field(True, description="a file the task or a candidate answer names is read before the "
                                                 "answer stands")
    figures: bool = Field(True, description="a number of a candidate answer that nothing the run read backs (in "
                                            "either decimal convention) sends it back to be computed; the English "
                                            "rules, where they apply, check figures with their units instead")
    plans: bool = Field(True, description="once tools have run, a candidate answer that names a tool the run has "
                                          "not called (a plan of the next step, in prose) is asked again with "
                                          "that tool named")
    named_facts: bool = Field(True, description="a calculator call that names a column of a table the run read "
                                                "(sum(minutes) / len(minutes)) is computed over the values read")
    english_rules: Literal["off", "english", "always"] = Field(
        "english", description="the checks that read English words (units, 'how many', 'total'): off; only for "
                               "a task found to be in English; always")


class ToolConfig(Section):
    name: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$")
    kind: Literal["builtin", "python", "shell"] = "builtin"
    description: str = ""
    target: str | None = Field(None, description="python: module:function or file.py:function; "
                                                  "shell: argv template with {arg} placeholders (no shell)")
    parameters: dict[str, Any] = Field(default_factory=dict,
                                       description="JSON schema of the arguments; builtins have their own")
    limits: dict[str, Any] = Field(default_factory=dict, description="per-tool overrides of agent.sandbox")
    roots: list[Path] = Field(default_factory=list, description="files and folders the tool may read (read-only; "
                                                                "relative to the service's working directory); "
                                                                "a python tool also imports from them")
    network: bool = Field(False, description="the tool may use the network (else it has none, loopback "
                                             "included, under bubblewrap)")

    @field_validator("target")
    @classmethod
    def _target_shape(cls, v: str | None, info: Any) -> str | None:
        if info.data.get("kind") == "python" and v and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError("python target must be module:function or path/file.py:function")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters_are_an_object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        import jsonschema  # only needed when a schema is given
        try:
            jsonschema.Draft202012Validator.check_schema(v)
        except jsonschema.SchemaError as err:
            raise ValueError(f"not a valid JSON schema: {err.message}") from None
        if v.get("type") != "object":
            raise ValueError("tool parameters must be a JSON schema with type: object")
        return v


class AgentConfig(Section):
    tools: list[ToolConfig] = Field(default_factory=lambda: [ToolConfig(name="calculator")])
    mcp_servers: list[McpServerConfig] = Field(default_factory=list, description="MCP servers whose tools the "
                                                                                  "tool service offers too")
    max_iterations: int = Field(8, ge=1, le=1000)
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    tool_isolation: Literal["auto", "bubblewrap", "off"] = Field(
        "auto", description="python/shell tools run under bubblewrap (namespaces: only their roots visible, no "
                            "network, a kill that reaches every process they start); auto: when bwrap is "
                            "installed and works, else rlimits only (logged); bubblewrap: refuse to start without it "
                            "when a python/shell tool or stdio MCP server is configured")
    tool_uid: int = Field(65534, ge=1, le=(1 << 32) - 2, description="uid (and gid) tools run as when the "
                                                                      "service runs as root: one no other "
                                                                      "process uses (default nobody)")
    file_roots: list[Path] = Field(default_factory=list, description="directories file_reader may read under")
    max_file_bytes: int = Field(1 << 20, ge=1, le=1 << 30, description="file_reader refuses bigger files")
    memory_collection: str = Field("memories", min_length=1, max_length=128, description="memory_search's collection")
    model: str | None = Field(None, max_length=64, description="engine model name the agent chats with; "
                                                                "null: the inference service's default")
    max_step_tokens: int = Field(320, ge=32, le=8192, description="tokens for one reply (text and tool calls)")
    recall_k: int = Field(3, ge=0, le=50, description="memories recalled into a run's first prompt; 0 = off")
    recall_min_score: float = Field(0.35, ge=-1, le=1, description="cosine similarity a recalled memory needs")
    temperature: float = Field(0.0, ge=0, le=2)
    answer_checks: int = Field(2, ge=0, le=20, description="candidate answers a run may send back (the step "
                                                            "policy's checks: agent.policy); 0 = take the first "
                                                            "answer")
    policy: StepPolicyConfig = Field(default_factory=StepPolicyConfig)

    @field_validator("tools")
    @classmethod
    def _tools_are_usable(cls, tools: list[ToolConfig]) -> list[ToolConfig]:
        _named_with_limits("tool", tools)
        for t in tools:
            if t.name == FINAL_ANSWER:
                raise ValueError(f"{FINAL_ANSWER!r} is reserved for ending a run")
            if t.kind == "builtin" and t.name not in BUILTIN_TOOLS:
                raise ValueError(f"no builtin tool {t.name!r} (builtins: {', '.join(BUILTIN_TOOLS)})")
            if t.kind != "builtin" and not (t.target and t.parameters):
                raise ValueError(f"tool {t.name!r}: a {t.kind} tool needs a target and a parameters schema")
        return tools

    @field_validator("mcp_servers")
    @classmethod
    def _servers_are_usable(cls, servers: list[McpServerConfig]) -> list[McpServerConfig]:
        _named_with_limits("MCP server", servers)
        return servers

    def limits_for(self, tool: ToolConfig) -> SandboxLimits:
        """The sandbox defaults with the tool's own overrides (validated like the defaults)."""
        return SandboxLimits.model_validate({**self.sandbox.model_dump(), **tool.limits})

    def mcp_limits(self, server: McpServerConfig) -> SandboxLimits:
        """An MCP server's limits: the sandbox defaults, CPU seconds for a long-lived process, its overrides."""
        return SandboxLimits.model_validate({**self.sandbox.model_dump(), "cpu_s": MCP_CPU_S, **server.limits})


def _named_with_limits(what: str, items: list[ToolConfig] | list[McpServerConfig]) -> None:
    """Each name declared once, each ``limits`` a valid override of the sandbox's."""
    names = [i.name for i in items]
    for name in {n for n in names if names.count(n) > 1}:
        raise ValueError(f"{what} {name!r} declared twice")
    for item in items:
        try:
            SandboxLimits.model_validate(item.limits)
        except ValidationError as err:
            raise ValueError(f"{what} {item.name!r} limits: {'; '.join(error_lines(err))}") from None
