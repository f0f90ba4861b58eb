"""The ``gateway`` section: the OpenAI-compatible HTTP gateway (services/gateway): where it listens, who may
call it, and how much one request may ask for."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from shared.config.base import Section


class GatewayConfig(Section):
    host: str = Field("127.0.0.1", min_length=1,
                      description="address the HTTP server binds; anything but loopback refuses to start "
                                  "without API keys (scripts/keys api-key NAME)")
    port: int = Field(8000, ge=0, le=65535, description="0 = an ephemeral port (health's 'url' says which)")
    api_keys_file: Path | None = Field(None, description="hashed API keys written by scripts/keys; default "
                                                         "keys_dir/api_keys. Once it holds a key, every request "
                                                         "needs one (Authorization: Bearer KEY), loopback too")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="larger request bodies answer 413")
    request_timeout_s: float = Field(300.0, gt=0, le=86400,
                                     description="a request (a whole stream included) running longer answers "
                                                 "504, or ends its stream with a timeout error")
    max_concurrent: int = Field(32, ge=1, le=4096, description="HTTP requests in flight at once, every route "
                                                              "counted (a stream until its last byte); more "
                                                              "answer 429 with Retry-After")
    allowed_hosts: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, description="names a request's Host header may carry besides localhost, 127.0.0.1, "
                                          "::1 and gateway.host (a web page re-pointing its own name at this box "
                                          "by DNS rebinding still sends its own); '*' allows any")
    feedback_per_minute: int = Field(30, ge=1, le=100000, description="POST /v1/feedback without API keys "
                                                                      "(loopback): at most this many a minute, "
                                                                      "more answer 429")
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of 429 and 503 answers")
    sse_ping_s: float = Field(15.0, gt=0, le=3600, description="an SSE comment this often keeps idle "
                                                              "streams (long prefills) alive through proxies")
    loop_stall_s: float = Field(10.0, gt=0, le=3600, description="the HTTP event loop silent this long reads "
                                                                "unhealthy, so the watchdog restarts the gateway")
    agent_wait_s: float = Field(600.0, gt=0, le=86400,
                                description="a /v1/responses run waiting for its caller's tool result is dropped "
                                            "after this long (a robot's drive or a person's answer takes minutes; "
                                            "a caller that vanished holds its run's history no longer)")
