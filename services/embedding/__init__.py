"""Embedding service: llama.cpp in embedding mode."""

from shared.cores import share_cores_with_openmp

share_cores_with_openmp()  # before any module of this package loads llama_cpp
