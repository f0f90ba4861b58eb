"""Magnitude: self-optimizing on-device inference for autonomous agents.

The user API: the ZeroMQ clients (from ``shared.client``, the transport every layer uses) and the agent.
"""

from shared.client import RETRYABLE, AsyncClient, Client, GenerateResult, Restart, Retry, ServiceError

__all__ = ["RETRYABLE", "AsyncClient", "Client", "GenerateResult", "Restart", "Retry", "ServiceError"]
