"""The peer: llama.cpp's own ``llama-server``, built from the llama.cpp vendored in the pinned llama-cpp-python
(``native/build_llama_server.sh``, cached), so both sides run the same kernels. One way to build, start, wait
for and stop it, for every benchmark that runs it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from scripts.bench import REPO


def build() -> str:
    """The binary's path (built on first use: minutes; the build's progress goes to stderr)."""
    print("llama-server: native/build_llama_server.sh (cached) ...", file=sys.stderr, flush=True)
    out = subprocess.run(["bash", str(REPO / "native" / "build_llama_server.sh")], check=True,
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHON=sys.executable))
    return out.stdout.strip().splitlines()[-1]


def version(binary: str) -> str:
    """Its ``version: ...`` line (it prints it on stderr), for the table's heading."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server on a free loopback port, serving ``model`` with ``args`` (threads, slots, context ...).

    ``start`` returns once ``/health`` answers 200 and stops the process if it never does; use it as a context
    manager or call ``stop``."""

    def __init__(self, binary: str, model: Path, args: list[str], log: Path, timeout_s: float = 300):
        self.binary, self.model, self.args, self.log, self.timeout_s = binary, model, list(args), log, timeout_s
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def start(self) -> LlamaServer:
        self.port = free_port()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([self.binary, "-m", str(self.model), "--host", "127.0.0.1",
                                          "--port", str(self.port), *self.args], stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:  # SIGTERM (SystemExit) or no health while it loads: stop it, callers never will
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"llama-server exited with {self.proc.returncode}; {self._tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
            time.sleep(0.2)
        sys.exit(f"llama-server not healthy in {self.timeout_s:.0f} s; {self._tail()}")

    def _tail(self) -> str:
        return f"the end of {self.log}:\n{self.log.read_bytes()[-2000:].decode(errors='replace')}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
