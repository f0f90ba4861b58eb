"""Code every Magnitude process shares: wire protocol, shm buffers, config, logging, service loop."""

import os

# llama.cpp's CPU threads come from OpenMP (libgomp), whose threads spin while they wait.
# On an edge box several llama.cpp processes (chat, embedding) share a few cores, and
# spinning threads starve each other. Measured here (Gemma 270M decode, 2 cores):
#   libgomp default:                 alone ~48 tok/s, two processes at once  0.8 tok/s each
#   OMP_WAIT_POLICY=PASSIVE:         alone  27 tok/s, two processes          27 tok/s each
#   PASSIVE + GOMP_SPINCOUNT=1000:   alone  47 tok/s, two processes          22 tok/s each
# A short spin keeps full speed alone and degrades gracefully when shared. Set before
# llama_cpp loads libgomp; values in the environment win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
