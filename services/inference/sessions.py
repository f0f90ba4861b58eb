"""Which session's KV cache lives in which llama.cpp sequence ("slot").

The context holds ``n_slots`` sequences. A session keeps its slot between
steps, so a follow-up prompt pays only for its new tokens. When a new session
needs a slot and none is free, the least recently used one is *parked*: only
that sequence's KV is copied out (``llama_state_seq_get_data``), bounded by a
memory budget with LRU eviction, and copied back in when the session returns.
That is far cheaper than saving or loading the whole context.

The KV operations are passed in (``KvOps``) so this bookkeeping is testable
without a model.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol import ErrorCode, ProtocolError


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: the KV that can be kept."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KvOps(Protocol):
    def save_seq(self, seq_id: int) -> bytes: ...
    def load_seq(self, seq_id: int, state: bytes) -> bool: ...
    def clear_seq(self, seq_id: int) -> None: ...


@dataclass
class Slot:
    seq_id: int
    session: str | None = None
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence, in order
    last_used: float = 0.0
    busy: bool = False  # a request is generating in it: not to be parked, reused or evicted


@dataclass
class _Parked:
    tokens: list[int]
    state: bytes


@dataclass
class Acquired:
    slot: Slot
    source: str  # "resident" | "restored" | "cold"
    switch_ms: float  # time spent parking another session and restoring this one


class SessionTable:
    def __init__(self, n_slots: int, park_budget_bytes: int, kv: KvOps):
        self.slots = [Slot(seq_id=i) for i in range(n_slots)]
        self.park_budget_bytes = park_budget_bytes
        self._kv = kv
        self._parked: OrderedDict[str, _Parked] = OrderedDict()
        self.parked_bytes = 0

    def can_admit(self, session: str | None) -> bool:
        """Whether a request of ``session`` can start now: its own slot is idle, or an idle slot exists."""
        own = self._resident(session)
        if own is not None:
            return not own.busy
        return any(not s.busy for s in self.slots)

    def _resident(self, session: str | None) -> Slot | None:
        return next((s for s in self.slots if session is not None and s.session == session), None)

    def acquire(self, session: str | None) -> Acquired:
        """The slot to run a request of ``session`` in (``None`` = stateless: always cold); it is held
        busy until ``release``."""
        if not self.can_admit(session):
            raise ProtocolError(ErrorCode.BUSY, "every session slot is generating; retry later")
        t0 = time.perf_counter()
        slot = self._resident(session)
        source = "resident"
        if slot is None:
            slot = self._free_slot()
            self._kv.clear_seq(slot.seq_id)
            slot.session, slot.tokens, source = session, [], "cold"
            parked = self._parked.pop(session, None) if session is not None else None
            if parked is not None:
                self.parked_bytes -= len(parked.state)
                if self._kv.load_seq(slot.seq_id, parked.state):
                    slot.tokens, source = parked.tokens, "restored"
                else:
                    self._kv.clear_seq(slot.seq_id)
        slot.last_used = time.monotonic()
        slot.busy = True
        return Acquired(slot, source, round((time.perf_counter() - t0) * 1000, 3))

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()

    def _free_slot(self) -> Slot:
        idle = [s for s in self.slots if not s.busy]
        free = [s for s in idle if s.session is None]
        if free:
            return min(free, key=lambda s: s.last_used)
        victim = min(idle, key=lambda s: s.last_used)
        self._park(victim)
        return victim

    def _park(self, slot: Slot) -> None:
        if self.park_budget_bytes > 0 and slot.session is not None and slot.tokens:
            state = self._kv.save_seq(slot.seq_id)
            if len(state) <= self.park_budget_bytes:
                self._parked[slot.session] = _Parked(list(slot.tokens), state)
                self.parked_bytes += len(state)
                while self.parked_bytes > self.park_budget_bytes:
                    _, evicted = self._parked.popitem(last=False)
                    self.parked_bytes -= len(evicted.state)
        slot.session, slot.tokens = None, []

    def drop(self, session: str) -> bool:
        """Forget a session's KV wherever it lives (not while it generates); True if there was any."""
        found = False
        for slot in self.slots:
            if slot.session == session and not slot.busy:
                self._kv.clear_seq(slot.seq_id)
                slot.session, slot.tokens = None, []
                found = True
        parked = self._parked.pop(session, None)
        if parked is not None:
            self.parked_bytes -= len(parked.state)
            found = True
        return found

    def describe(self, session: str | None) -> dict:
        """Totals, plus where ``session``'s own KV lives: never other sessions' ids (they are capabilities)."""
        resident = {s.session: len(s.tokens) for s in self.slots if s.session is not None}
        if session in resident:
            mine = {"where": "resident", "tokens": resident[session]}
        elif session in self._parked:
            mine = {"where": "parked", "tokens": len(self._parked[session].tokens)}
        else:
            mine = {"where": "none", "tokens": 0}
        return {"slots": len(self.slots), "resident": len(resident), "parked": len(self._parked),
                "parked_mb": round(self.parked_bytes / 2**20, 2), "session": mine}
