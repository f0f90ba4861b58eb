"""The long test runs, each a command of its own that the test suite runs briefly: chaos (services
killed under load), coverage-guided fuzzing, and load and soak. `python -m scripts.checks.NAME --help`."""
