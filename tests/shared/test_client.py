"""The client fails fast and visibly when no service answers."""

import asyncio
import socket
import time

import pytest

from shared.client import AsyncClient, Client, ServiceError


def free_tcp_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_missing_ipc_socket_is_unavailable_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as info:
        Client(f"ipc://{tmp_path}/nothing.sock").health()
    assert info.value.code == "unavailable" and time.monotonic() - t0 < 1


def test_silent_endpoint_times_out_with_clear_error():
    client = Client(free_tcp_endpoint(), timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as info:
        client.generate("hi")
    assert info.value.code == "timeout" and "'generate'" in info.value.message
    assert 0.4 < time.monotonic() - t0 < 3


def test_async_timeout():
    async def run():
        c = AsyncClient(free_tcp_endpoint(), timeout_s=0.3)
        try:
            await c.health()
        finally:
            c.close()
    with pytest.raises(ServiceError) as info:
        asyncio.run(run())
    assert info.value.code == "timeout"


def test_a_misspelt_keyword_is_a_type_error_at_the_call_naming_it(tmp_path):
    """``max_token=5`` would reach the service unread; it is refused before anything is sent, naming the field."""
    with Client(f"ipc://{tmp_path}/none.sock", timeout_s=0.5) as client:
        with pytest.raises(TypeError, match=r"'max_token'.*did you mean 'max_tokens'"):
            client.chat([{"role": "user", "content": "hi"}], max_token=5)
        with pytest.raises(TypeError, match="'max_token'"):
            client.generate("hi", max_token=5)
