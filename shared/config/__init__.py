"""One YAML file configures the whole stack; every value has a default that runs.

Sections, each in its own module: ``engine`` (the chat model and how it runs), ``agent`` (tools, MCP servers, loop
limits), ``runtime`` (where sockets, data and logs live; queue and frame limits) and ``metrics``,
``memory`` (embedding, retrieval, context budget), ``optimizer`` and ``watchdog`` (operations), ``gateway``
(the OpenAI-compatible HTTP gateway).
``load_config`` raises ``ConfigError`` naming each bad value and why. Everything is importable from
``shared.config`` itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from shared.config.agent import BUILTIN_TOOLS, FINAL_ANSWER, AgentConfig, SandboxLimits, ToolConfig
from shared.config.base import SERVICE_NAMES, WATCHDOG_NAME, ConfigError, Section, error_lines, magnitude_home
from shared.config.engine import KNOBS, REBUILD_KNOBS, EngineConfig, TunableSettings
from shared.config.gateway import GatewayConfig
from shared.config.mcp import McpServerConfig
from shared.config.memory import DEFAULT_EMBEDDING_MODEL_FILE, ContextBudget, MemoryConfig
from shared.config.operations import OptimizerConfig, ThermalConfig, WatchdogConfig
from shared.config.runtime import MetricsConfig, RuntimeConfig, ipc_path

__all__ = ["BUILTIN_TOOLS", "DEFAULT_EMBEDDING_MODEL_FILE", "FINAL_ANSWER", "KNOBS",
           "REBUILD_KNOBS", "SERVICE_NAMES", "WATCHDOG_NAME", "AgentConfig", "Config", "ConfigError",
           "ContextBudget", "EngineConfig", "GatewayConfig", "McpServerConfig", "MemoryConfig", "MetricsConfig",
           "OptimizerConfig",
           "RuntimeConfig", "SandboxLimits", "ThermalConfig", "ToolConfig", "TunableSettings", "WatchdogConfig",
           "dump_config", "error_lines", "ipc_path", "load_config", "magnitude_home", "parse_config"]


class Config(Section):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)


def parse_config(data: Any, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping with engine:, agent:, runtime:")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: invalid configuration\n" + "\n".join(f"  {line}" for line in error_lines(err))) from None


def load_config(path: str | Path | None = None) -> Config:
    """Load ``path`` (or ``$MAGNITUDE_CONFIG``); no file means all defaults."""
    path = path or os.environ.get("MAGNITUDE_CONFIG")
    if not path:
        return Config()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
