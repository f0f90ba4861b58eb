"""The ``gateway`` section: the OpenAI-compatible HTTP gateway (services/gateway): where it listens, who may
call it, and how much one request may ask for."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from shared.config.base import Section
from shared.protocol import MAX_BODY_DEPTH


class GatewayConfig(Section):
    host: str = Field("127.0.0.1", min_length=1,
                      description="address the HTTP server binds; anything but loopback refuses to start "
                                  "without API keys (scripts/ops/keys api-key NAME)")
    port: int = Field(8000, ge=0, le=65535, description="0 = an ephemeral port (health's 'url' says which)")
    api_keys_file: Path | None = Field(None, description="hashed API keys written by scripts/ops/keys; default "
                                                         "keys_dir/api_keys. Once it holds a key, every request "
                                                         "needs one (Authorization: Bearer KEY), loopback too")
    allow_keyless_loopback: bool = Field(False, description="serve loopback without API keys: then every local "
                                         "account runs this box's tools (logged as a warning at start). By "
                                         "default a first start makes a key (keys_dir/local.key, mode 0600)")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="larger request bodies answer 413")
    max_json_depth: int = Field(64, ge=16, le=MAX_BODY_DEPTH,
                                description="request bodies with arrays and objects nested deeper answer 400, "
                                            "before anything parses them (a real tool's JSON schema nests 10-20; "
                                            f"the services accept {MAX_BODY_DEPTH} at most)")
    request_timeout_s: float = Field(300.0, gt=0, le=86400,
                                     description="a request (a whole stream included) running longer answers "
                                                 "504, or ends its stream with a timeout error")
    max_concurrent: int = Field(32, ge=1, le=4096, description="HTTP requests in flight at once, every route "
                                                              "counted (a stream until its last byte); more "
                                                              "answer 429 with Retry-After")
    max_concurrent_per_key: int = Field(16, ge=1, le=4096,
                                        description="HTTP requests of one API key in flight at once (keyless "
                                                    "callers together count as one key); more answer 429, so "
                                                    "one caller cannot hold every slot of gateway.max_concurrent")
    header_timeout_s: float = Field(10.0, gt=0, le=3600,
                                    description="a connection whose next request's headers are not complete this "
                                                "long after it opened (or after its last response) is closed")
    body_timeout_s: float = Field(10.0, gt=0, le=3600,
                                  description="a request body not complete this long after its headers "
                                              "answers 408 (a client that declares a body and stalls holds "
                                              "its request slot no longer)")
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
                                description="a /v1/responses run waiting for its caller's tool result, and a "
                                            "finished response kept for the conversation's next turn, are dropped "
                                            "after this long (a robot's drive or a person's answer takes minutes; "
                                            "a caller that vanished holds its run's history no longer)")
    max_parked_runs: int = Field(1000, ge=1, le=1_000_000,
                                 description="runs waiting for their caller's tool result, all callers together; "
                                             "one more is answered 429 (each holds its history in memory)")
    max_parked_runs_per_key: int = Field(50, ge=1, le=1_000_000,
                                         description="runs waiting for their caller's tool result, per API key "
                                                     "(or for all keyless callers together)")
    max_stored_responses: int = Field(1000, ge=1, le=1_000_000,
                                      description="finished /v1/responses responses kept (GET, previous_response_id), "
                                                  "all callers together; over it the oldest is dropped")
    max_stored_responses_per_key: int = Field(100, ge=1, le=1_000_000,
                                              description="finished responses kept per API key; over it that key's "
                                                          "oldest is dropped")
