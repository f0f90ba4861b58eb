"""Code every Magnitude process shares: wire protocol, shm buffers, config, logging, service loop."""

import os

# llama.cpp's CPU threads come from OpenMP, which by default spins while waiting. On an edge
# box several llama.cpp processes (chat, embedding) share a few cores, and spinning threads
# starve each other: decode fell from ~16 to 0.8 tokens/s with two processes on 2 cores here.
# Passive waiting costs nothing measurable alone. Set before llama_cpp loads libgomp; an
# explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
