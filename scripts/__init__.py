"""The repository's scripts, by job: ``bench/`` benchmarks, ``provision/`` setup and build recipes, ``ops/`` commands
for a running stack, ``checks/`` the long test runs; ``setup``, ``test`` and ``lint`` are the entry points.

A package so that scripts import each other by name (``python -m scripts.bench.agent``, from the repository root).
"""
