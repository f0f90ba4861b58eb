"""The OpenAI-compatible HTTP gateway: HTTP in, the ZeroMQ mesh behind (see docs/gateway.md)."""
