"""Magnitude: self-optimizing on-device inference for autonomous agents."""

from magnitude.client import AsyncClient, Client, GenerateResult, ServiceError

__all__ = ["AsyncClient", "Client", "GenerateResult", "ServiceError"]
