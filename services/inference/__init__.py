"""Chat inference service: llama.cpp with per-session KV cache reuse."""
