"""How often less urgent work may share a decode step with more urgent work (docs/scheduler.md, "Pace").

A step's cost grows with its tokens, and on a CPU it grows steeply: on 2 cores the 1.5B decodes one
sequence's token in 23 ms, two sequences' in 44 ms and four in 66 ms. Decoded beside three background
sequences in every step, an interactive agent writes at a third of its speed alone; never beside them, the
background stops whenever the agent speaks. On a GPU the same four tokens cost about what one does, and
batching everything is right. ``UrgentPace`` decides per step from the engine's measured step costs, so one
rule fits both: the most urgent class keeps at least ``engine.priority_pace`` of its speed alone, and the less
urgent work joins as many of its steps as that leaves room for.
"""

from __future__ import annotations

#: Shared steps in a row at most: then one urgent-only step, so the measured cost of such a step stays fresh.
#: Without it a figure measured high once (another process ran meanwhile) made every later step shared, and a
#: step that is never taken is never measured again.
REMEASURE_AFTER = 16


class UrgentPace:
    """A budget in seconds: each step of the most urgent class may cost ``alone_s / pace``, where ``alone_s``
    is what the step would cost with that class only. A step without the less urgent work saves what it
    leaves of that; a step with it spends it. Savings are capped at one shared step, so a long urgent-only
    stretch does not buy a burst of shared steps."""

    def __init__(self) -> None:
        self.credit = 0.0
        self.shared_in_row = 0

    def join(self, pace: float, alone_s: float, together_s: float) -> bool:
        """Whether this step carries the less urgent work too (``pace`` 0: always; 1: only when it is free)."""
        if pace <= 0:
            return True
        allowance = alone_s / pace
        joined = self.credit + allowance >= together_s and self.shared_in_row < REMEASURE_AFTER
        self.shared_in_row = self.shared_in_row + 1 if joined else 0
        self.credit = min(self.credit + allowance - (together_s if joined else alone_s), together_s)
        return joined

    def reset(self) -> None:
        """One class only in this step: nothing to share, nothing saved."""
        self.credit, self.shared_in_row = 0.0, 0
