"""Coverage-guided fuzzing (atheris) of the protocol decoder and every handler's body validation, short.

The run is ``scripts/checks/fuzz.py`` in its own process (libFuzzer ends the process it runs in); a finding (an
exception other than a typed ProtocolError, or a crash) fails it. The counts go to the test summary. The
long run (1,000,000 inputs and more) is documented in docs/security.md.
"""

import re
import subprocess
import sys

import pytest

from tests.conftest import FUZZ_COUNTS, REPO, REPORT, require_model

RUNS = 50_000


@pytest.mark.model
def test_coverage_guided_fuzzing_finds_nothing():
    require_model()
    done = subprocess.run([sys.executable, "-m", "scripts.checks.fuzz", "--runs", str(RUNS)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and f"Done {RUNS} runs" in output, output[-4000:]
    counts = re.findall(r"^fuzz counts: (.*)$", output, re.M)[-1]
    coverage = re.findall(r"cov: (\d+)", output)[-1]
    FUZZ_COUNTS["atheris"] = RUNS
    REPORT.append(f"atheris: {counts} (coverage edges: {coverage})")
    assert f"inputs={RUNS}" in counts and "handlers=" in counts and "ok=" in counts
