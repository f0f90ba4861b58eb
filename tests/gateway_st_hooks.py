"""schemathesis hooks for runs against the gateway: real model names and short generations.

Random model names only ever reach the 404 path, so half of the generated bodies
get a served name (from ``GATEWAY_ST_MODELS``, comma-separated). Generations are
capped at a few tokens, so a run measures the API, not the model's decode speed.
Both changes keep a body exactly as valid or invalid as it was: a string model
name becomes another string, a valid token count a smaller valid one.

    SCHEMATHESIS_HOOKS=tests.gateway_st_hooks GATEWAY_ST_MODELS=a,b st run URL/openapi.json
"""

from __future__ import annotations

import os
import random

import schemathesis

MAX_TOKENS = 8
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _models() -> list[str]:
    return [m for m in os.environ.get("GATEWAY_ST_MODELS", "").split(",") if m]


@schemathesis.hook
def map_case(context, case):
    """``map_case`` rather than ``map_body``: it also sees the coverage phase's cases."""
    if isinstance(case.body, dict):
        _adjust(case.body)
    return case


def _adjust(body: dict) -> None:
    models = _models()
    if models and isinstance(body.get("model"), str) and random.random() < 0.5:
        body["model"] = random.choice(models)
    for name in _TOKEN_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
