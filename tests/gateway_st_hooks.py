"""schemathesis hooks for runs against the gateway: real model names and short generations.

Random model names only ever reach the 404 path, so half of the generated bodies
get a served name: for /v1/embeddings ``GATEWAY_ST_EMBEDDING_MODEL``, elsewhere one
of ``GATEWAY_ST_MODELS`` (comma-separated). Generations are
capped at a few tokens, so a run measures the API, not the model's decode speed.
Only positive cases are changed, and they stay valid: a model name becomes
another, a token count a smaller one.

    SCHEMATHESIS_HOOKS=tests.gateway_st_hooks GATEWAY_ST_MODELS=a,b GATEWAY_ST_EMBEDDING_MODEL=c st run URL
"""

from __future__ import annotations

import os
import random

import schemathesis

MAX_TOKENS = 8
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _models(path: str) -> list[str]:
    names = (os.environ.get("GATEWAY_ST_EMBEDDING_MODEL", "") if path.endswith("/embeddings")
             else os.environ.get("GATEWAY_ST_MODELS", ""))
    return [m for m in names.split(",") if m]


@schemathesis.hook
def map_case(context, case):
    """``map_case`` rather than ``map_body``: it also sees the coverage phase's cases. Negative cases (built to
    violate the schema) are left alone, so no adjustment can make one valid."""
    negative = case.meta is not None and case.meta.generation.mode == schemathesis.GenerationMode.NEGATIVE
    if isinstance(case.body, dict) and not negative:
        _adjust(case.body, _models(case.operation.path))
    return case


def _adjust(body: dict, models: list[str]) -> None:
    if models and isinstance(body.get("model"), str) and random.random() < 0.5:
        body["model"] = random.choice(models)
    for name in _TOKEN_FIELDS:
        value = body.get(name)
        # JSON's 2055.0 is a whole number too, and the schema takes it: a float slipped past an int-only check
        # and generated a thousand tokens, past schemathesis's 10 s read timeout.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
