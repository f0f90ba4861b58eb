"""docs/frameworks/*.md as their readers run them: each page's two Python programs (one through /v1/responses,
one through /v1/chat/completions with the agent alias), run unchanged in their own interpreter against the real
stack, with only MAGNITUDE_URL and MAGNITUDE_API_KEY set. Each program reads a note file with its own tool,
multiplies, and prints the answer last: 14 jars of 375 g are 5250 g."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, REPORT
from tests.services.gateway.test_gateway_agent import FIRST_START_KEYS, stack  # noqa: F401  (the module's stack: inference, tools, gateways)

PAGES = sorted((REPO / "docs" / "frameworks").glob("*.md"))
BLOCKS_PER_PAGE = 2  # /v1/responses, then /v1/chat/completions with "default:agent"


def python_blocks(page) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.DOTALL | re.MULTILINE)


def numbers_in(line: str) -> list[str]:
    """The line's numbers with thousands separators dropped: "5,250", "5 250", "5.250" and "5250.0" hold 5250."""
    line = re.sub(r"(?<=\d)[,.\s\u00a0\u202f'](?=\d{3}(?!\d))", "", line)
    return re.findall(r"\d+", line)


def test_thousands_separators_are_read_as_one_number():
    assert numbers_in("There are 5,250 g.") == ["5250"]
    assert numbers_in("5 250 grams; 5.250 g; 5250.0 g") == ["5250", "5250", "5250", "0"]
    assert "5250" not in numbers_in("52500 g, 5251 g")


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_framework_page_has_its_two_programs(page):
    """A page that loses a block would lose its test with it."""
    blocks = python_blocks(page)
    assert len(blocks) == BLOCKS_PER_PAGE, f"{page.name}: {len(blocks)} python blocks"
    assert '"default"' in blocks[0] and '"default:agent"' in blocks[1], page.name


@pytest.mark.model
@pytest.mark.parametrize("page,index", [(p, i) for p in PAGES for i in range(BLOCKS_PER_PAGE)],
                         ids=[f"{p.stem}-{i + 1}" for p in PAGES for i in range(BLOCKS_PER_PAGE)])
def test_a_framework_page_program_finishes_the_task_through_magnitude(stack, monkeypatch, page, index):  # noqa: F811
    url = stack["open"]
    monkeypatch.setenv("MAGNITUDE_URL", f"{url}/v1")
    monkeypatch.setenv("MAGNITUDE_API_KEY", FIRST_START_KEYS[url])
    program = python_blocks(page)[index]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines and "5250" in numbers_in(lines[-1]), out.stdout
    REPORT.append(f"{page.stem}-{index + 1} ({time.monotonic() - t0:.0f} s) printed: {lines[-1]}")
