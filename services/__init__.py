"""One package per Magnitude process; each runs with ``python -m services.<name>``."""
