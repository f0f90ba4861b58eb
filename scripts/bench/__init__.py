"""Benchmarks: each measures Magnitude and its peer (or two settings) side by side in one run, because the box is
shared and noisy. Run one from the repository root: ``.venv/bin/python -m scripts.bench.NAME --help``.

Shared parts: ``common`` (a real inference service), ``llama_server`` (the peer), ``backends`` (both behind one
streaming interface), ``prompts`` and ``stats``. Figures live in docs/benchmarks.md, not here.
"""

from pathlib import Path

#: The repository root: where ``python -m scripts.bench.NAME`` runs, and native/'s build recipes are.
REPO = Path(__file__).resolve().parents[2]
