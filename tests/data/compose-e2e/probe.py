"""A python tool for tests/system/test_compose_e2e.py: what a tool in the tools container can see."""

import os


def read(path):
    try:
        if os.path.isdir(path):
            return f"listed: {sorted(os.listdir(path))}"
        with open(path, "rb") as f:
            return "read: " + f.read(200).decode("utf-8", "replace")
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
