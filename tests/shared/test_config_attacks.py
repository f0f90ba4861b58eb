"""Knob ranges defined twice (issue 16): each place that takes a knob accepts what the engine does."""

from __future__ import annotations

import pytest

from shared.config import EngineConfig, TunableSettings

pytestmark = pytest.mark.security


def test_knob_ranges_are_defined_once():
    """engine.configure, strategy files and optimizer overrides accept a knob value exactly when the engine does
    (they disagreed: prefill_chunk_size >= 1 vs >= 16, max_batch_size <= 8192 vs <= 4096)."""
    def accepts(model, **values) -> bool:
        try:
            model(**values)
            return True
        except ValueError:
            return False

    for name in TunableSettings.model_fields:
        bounds = [getattr(m, a) for m in EngineConfig.model_fields[name].metadata for a in ("ge", "le")
                  if getattr(m, a, None) is not None]
        for value in {v for b in bounds for v in (b - 1, b, b + 1)}:
            room = {"max_batch_size": 8192} if name == "prefill_chunk_size" else {}  # its cross-field rule
            assert accepts(TunableSettings, **{name: value}) == accepts(EngineConfig, **room, **{name: value}), \
                (name, value)
