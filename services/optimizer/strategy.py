"""The learned strategy on disk: what the optimizer settled on, so a restarted box skips the warm-up.

``DATA_DIR/strategy.json`` (``optimizer.strategy_path``) holds a versioned,
pydantic-validated document. Writes are atomic (temporary file, fsync, rename,
fsync of the directory): a power cut leaves the old file or the new one, never
half of each. A file that does not parse or validate, or has another version,
is logged once (``strategy_rejected``), renamed aside (kept for a human, never
overwritten) and the optimizer starts from defaults.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.config import TunableSettings, error_lines

FORMAT: Final = "magnitude-strategy"
VERSION: Final = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfileRecord(_Strict):
    """The incumbent's measured speeds and the reference request they score (see policy.Profile)."""

    prefill_s_per_token: float | None = Field(None, ge=0)
    decode_s_per_token: float | None = Field(None, ge=0)
    ref_prefill_tokens: float = Field(ge=0)
    ref_decode_tokens: float = Field(ge=0)
    load_class: Literal["prefill", "decode"]


class DecisionRecord(_Strict):
    ts: float
    knob: str
    old: Any = None
    new: Any = None
    kept: bool
    gain: float
    reason: str


class Strategy(_Strict):
    format: Literal["magnitude-strategy"] = FORMAT
    version: Literal[1] = VERSION
    settings: TunableSettings = Field(default_factory=TunableSettings, description="the learned engine knobs")
    settings_id: str | None = Field(None, description="the engine's id for these settings, when known")
    settled: bool = Field(False, description="exploration finished: restore without a warm-up")
    profile: ProfileRecord | None = None
    decisions: list[DecisionRecord] = Field(default_factory=list)
    saved_at: float = 0.0


class StrategyRejected(ValueError):
    """A strategy document that cannot be used; the message says why."""


def parse(data: Any) -> Strategy:
    """Validate a strategy document (from a file or ``strategy.set``)."""
    if not isinstance(data, dict):
        raise StrategyRejected("not a JSON object")
    if data.get("format") != FORMAT:
        raise StrategyRejected(f"format is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise StrategyRejected(f"version {data.get('version')!r} is not supported (expected {VERSION})")
    try:
        return Strategy.model_validate(data)
    except ValidationError as err:
        raise StrategyRejected("; ".join(error_lines(err))) from None


def load(path: Path, log) -> Strategy | None:
    """The saved strategy, or None (no file, or a rejected one that is logged and set aside)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("strategy_rejected", path=str(path), reason=f"cannot read: {exc.strerror}")
        return None
    try:
        return parse(json.loads(text))
    except (ValueError, StrategyRejected) as exc:  # json.JSONDecodeError is a ValueError
        aside = path.with_name(f"{path.name}.rejected-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        path.rename(aside)
        log.error("strategy_rejected", path=str(path), reason=str(exc), moved_to=str(aside))
        return None


def save(path: Path, strategy: Strategy) -> None:
    """Write atomically: tmp file, fsync, rename over the old one, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(strategy.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
