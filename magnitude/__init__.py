"""Magnitude: self-optimizing on-device inference for autonomous agents."""

from magnitude.client import AsyncClient, Client, GenerateResult, Restart, Retry, ServiceError

__all__ = ["AsyncClient", "Client", "GenerateResult", "Restart", "Retry", "ServiceError"]
