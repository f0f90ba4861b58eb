"""Magnitude: self-optimizing on-device inference for autonomous agents.

The user API: the ZeroMQ clients (from ``shared.client``, the transport every layer uses) and the agent.
"""

import os

from shared.client import RETRYABLE, AsyncClient, Client, GenerateResult, Restart, Retry, ServiceError
from shared.protocol import Stats

__all__ = ["RETRYABLE", "AsyncClient", "Client", "GenerateResult", "Restart", "Retry", "ServiceError", "Stats",
           "api_key"]


def api_key(config_path: str | None = None) -> str:
    """The gateway key for this user's HTTP clients: ``$MAGNITUDE_API_KEY``, else the key the first start
    made (keys_dir/local.key, readable by this user only). Raises a clear error when there is none."""
    from services.gateway.keys import local_key_path, read_local_key
    from shared.config import load_config

    if os.environ.get("MAGNITUDE_API_KEY"):
        return os.environ["MAGNITUDE_API_KEY"]
    config = load_config(config_path)
    key = read_local_key(config)
    if key is None:
        raise RuntimeError(f"no gateway key at {local_key_path(config)}: start the stack once (magnitude up) "
                           "or make one with scripts/ops/keys api-key NAME and set MAGNITUDE_API_KEY")
    return key
