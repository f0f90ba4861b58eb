"""The long test runs, each a command of its own: chaos (services killed under load) and coverage-guided
fuzzing, which the test suite also runs briefly, and load and soak. `python -m scripts.checks.NAME --help`."""
