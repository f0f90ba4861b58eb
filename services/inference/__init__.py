"""Chat inference service: llama.cpp with per-session KV cache reuse."""

from shared.cores import share_cores_with_openmp

share_cores_with_openmp()  # before any module of this package loads llama_cpp
