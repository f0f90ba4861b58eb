"""Setup and build recipes beside `scripts/setup`: the wheelhouse and base image of an offline image build, and
the embedding model GGUF converted from its PyPI package. llama.cpp itself is built by native/'s recipes."""
