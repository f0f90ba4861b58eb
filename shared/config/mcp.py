"""``agent.mcp_servers``: MCP servers whose tools the tool service offers beside its own.

A stdio server is a command the tool service starts confined like a python/shell tool (bubblewrap
where it works, rlimits always); a streamable HTTP server is a URL, with headers whose ``${VAR}``
parts come from the service's environment, so keys stay out of the YAML (and are refused for a plain
``http://`` URL beyond loopback unless ``allow_plain_http_secrets``).
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from shared.config.base import Section

#: ``${NAME}`` in a header value: the service's environment variable NAME.
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: A long-lived server would hit the tools' per-call CPU default (10 s) in its first hour: its own default.
MCP_CPU_S = 3600


class McpServerConfig(Section):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$", description="the server's name; prefixes its tools' "
                                                                    "names when they collide with another's")
    command: list[str] = Field(default_factory=list, description="stdio: the server's argv, started sandboxed")
    env: dict[str, str] = Field(default_factory=dict, description="stdio: extra environment of the server")
    roots: list[Path] = Field(default_factory=list, description="stdio: files and folders the server may read "
                                                                "(read-only under bubblewrap)")
    network: bool = Field(False, description="stdio: the server may use the network (else none under bubblewrap)")
    url: str | None = Field(None, pattern=r"^https?://", description="streamable HTTP: the server's endpoint")
    headers: dict[str, str] = Field(default_factory=dict, description="streamable HTTP: sent with every request; "
                                                                      "${VAR} is the service's environment VAR")
    allow_plain_http_secrets: bool = Field(False, description="streamable HTTP: send ${VAR} header secrets to an "
                                                              "http:// URL beyond loopback (in clear on the wire)")
    limits: dict[str, Any] = Field(default_factory=dict, description="overrides of agent.sandbox: timeout_s "
                                                                     "and max_output_bytes per call; memory_mb, "
                                                                     "cpu_s (over the process's life, default "
                                                                     f"{MCP_CPU_S}), max_file_mb, max_processes "
                                                                     "for a stdio server's process")
    connect_timeout_s: float = Field(20.0, gt=0, le=600, description="start, handshake and tool listing")
    check_every_s: float = Field(5.0, gt=0, le=3600, description="a quiet server lists its tools again this "
                                                                 "often; one that does not answer within "
                                                                 "connect_timeout_s is restarted")
    backoff_s: float = Field(1.0, gt=0, le=600, description="wait before the first restart; doubles per failure")
    backoff_max_s: float = Field(30.0, gt=0, le=3600, description="longest wait between restarts")

    @model_validator(mode="after")
    def _one_transport(self) -> "McpServerConfig":
        if bool(self.command) == bool(self.url):
            raise ValueError(f"MCP server {self.name!r}: give either command (stdio) or url (streamable HTTP)")
        if self.url and (self.env or self.roots or self.network):
            raise ValueError(f"MCP server {self.name!r}: env, roots and network are for a stdio server")
        if self.command and self.headers:
            raise ValueError(f"MCP server {self.name!r}: headers are for a streamable HTTP server")
        if self._secrets_in_clear() and not self.allow_plain_http_secrets:
            raise ValueError(f"MCP server {self.name!r}: its headers carry ${{VAR}} secrets and {self.url} is plain "
                             "http:// beyond loopback, so they would cross the network in clear: use https://, or "
                             "set allow_plain_http_secrets: true for this server")
        return self

    def _secrets_in_clear(self) -> bool:
        """Secret headers for a plain-HTTP server off this box (loopback traffic never leaves it)."""
        if not (self.url or "").startswith("http://") or not any(_ENV_REF.search(v) for v in self.headers.values()):
            return False
        host = urlsplit(self.url).hostname or ""
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host != "localhost"

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command else "http"

    def resolved_headers(self) -> dict[str, str]:
        """The headers with each ``${VAR}`` replaced from the environment; a missing one is an error."""
        def value(match: re.Match) -> str:
            if match.group(1) not in os.environ:
                raise ValueError(f"MCP server {self.name!r}: header needs ${{{match.group(1)}}}, which is not set")
            return os.environ[match.group(1)]
        return {key: _ENV_REF.sub(value, text) for key, text in self.headers.items()}
