"""Which session's KV cache lives in which llama.cpp sequence ("slot"), and where else a prompt's KV can come from.

The context holds ``n_slots`` sequences. A session keeps its slot between steps, so a follow-up prompt pays only
for its new tokens. When a request starts, its KV comes from, in this order:

* ``resident`` - its session's own slot;
* ``restored`` - the session was *parked*: a new session needed a slot, none was free, and the least recently
  used idle one had only its sequence's KV copied out (``llama_state_seq_get_data``) into a RAM budget with
  LRU eviction; now it is copied back in. Far cheaper than saving or loading the whole context;
* ``disk`` - the session was written to disk when the service last drained (``SessionStore``);
* ``shared`` - another sequence already holds a prefix of the prompt (a system prompt, tool definitions, a
  few-shot block that many sessions share): that KV is copied (``state_seq_get/set_data``, then the tail
  trimmed) instead of computed again, at about 4 ms for 700 tokens against 0.8 s to prefill them here;
* ``cold`` - nothing to reuse.

A slot whose session ended or that served a request without a session keeps its tokens, so its KV stays a
donor; a free slot whose leftover KV shares the prompt's beginning is taken first (no copy at all).

**KV never crosses owners.** Every request has an owner (the API key's name, the CURVE identity, or the local
account: ``InferenceService`` says which), and a session id names a session *of that owner*. Donors, a free
slot's leftovers and sessions are matched only within the request's owner, so how many prompt tokens were
cached (which a client sees) says nothing about another owner's prompts: a guessed prefix scores the same
whether another tenant sent it or not.

A request that shares a prefix with a prompt some slot is *prefilling right now* waits for that prefill rather
than computing the same tokens a second time (``worth_waiting``; the scheduler asks before it admits).

The KV operations are passed in (``KvOps``) so this bookkeeping is testable without a model.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shared.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from services.inference.session_store import SessionStore

#: A copy from another sequence costs about as much as prefilling a few tokens; below this it is not worth it.
MIN_SHARED_TOKENS = 16


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: the KV that can be kept (compared 64 at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + 64, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


class KvOps(Protocol):
    def save_seq(self, seq_id: int) -> bytes: ...
    def load_seq(self, seq_id: int, state: bytes) -> bool: ...
    def clear_seq(self, seq_id: int) -> None: ...
    def trim_seq(self, seq_id: int, keep: int) -> None: ...


#: A session as the table knows it: (owner, session id); ids are only unique within their owner.
SessionKey = tuple[str, str]


@dataclass
class Slot:
    seq_id: int
    owner: str | None = None  # whose KV the sequence holds (kept after the session ends: leftovers are theirs)
    session: SessionKey | None = None
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence, in order
    last_used: float = 0.0
    busy: bool = False  # a request runs in it: not to be parked, reused or evicted
    planned: list[int] | None = None  # the prompt being prefilled into it (others sharing a prefix wait for it)


@dataclass
class _Parked:
    tokens: list[int]
    state: bytes


@dataclass
class Paused:
    """A running generation's KV, copied out of its slot to make room for a more urgent request (``pause``)."""

    owner: str
    session: SessionKey | None
    tokens: list[int]
    state: bytes


@dataclass
class Acquired:
    slot: Slot
    source: str  # "resident" | "restored" | "disk" | "shared" | "cold"
    switch_ms: float  # time spent parking, restoring and copying KV for this request
    cached: int  # prompt tokens whose KV the slot holds now (at most all but the last)
    shared: int = 0  # of those, tokens copied from another sequence


class SessionTable:
    def __init__(self, n_slots: int, park_budget_bytes: int, kv: KvOps, store: "SessionStore | None" = None,
                 share_prefixes: bool = True):
        self.slots = [Slot(seq_id=i) for i in range(n_slots)]
        self.park_budget_bytes = park_budget_bytes
        self.share_prefixes = share_prefixes
        self._kv = kv
        self._store = store
        self._parked: OrderedDict[SessionKey, _Parked] = OrderedDict()
        self.parked_bytes = 0
        self.paused = 0  # generations paused (``pause``) and not yet resumed: their KV needs this context

    def can_admit(self, session: SessionKey | None) -> bool:
        """Whether a request of ``session`` can start now: its own slot is idle, or an idle slot exists."""
        own = self.resident(session)
        if own is not None:
            return not own.busy
        return self.idle()

    def resident(self, session: SessionKey | None) -> Slot | None:
        """The slot that holds ``session``'s KV, if one does."""
        return next((s for s in self.slots if session is not None and s.session == session), None)

    def idle(self) -> bool:
        return any(not s.busy for s in self.slots)

    def worth_waiting(self, owner: str, prompt: list[int]) -> bool:
        """True when a slot of ``owner`` is prefilling a prompt that shares clearly more of ``prompt`` than any
        of its sequences holds now: waiting for it and copying beats computing the same prefix a second time."""
        if not self.share_prefixes:
            return False
        mine = [s for s in self.slots if s.owner == owner]
        planned = max((common_prefix_len(s.planned, prompt) for s in mine if s.planned), default=0)
        if planned < MIN_SHARED_TOKENS:
            return False
        have = max((common_prefix_len(s.tokens, prompt) for s in mine), default=0)
        return planned - have >= MIN_SHARED_TOKENS

    def acquire(self, owner: str, session: SessionKey | None, prompt: list[int], reuse: bool = True) -> Acquired:
        """A slot for a request of ``owner`` and ``session`` (None: no session) whose KV holds the longest prefix
        of ``prompt`` it can get from that owner's KV (none with ``reuse`` off); it is held busy until
        ``release``."""
        if not self.can_admit(session):
            raise ProtocolError(ErrorCode.BUSY, "every session slot is generating; retry later")
        t0 = time.perf_counter()
        donor = self._donor(owner, prompt) if reuse and self.share_prefixes else None
        slot = self.resident(session)
        source = "resident"
        if slot is None:
            slot, source = self._take_slot(owner, prompt, donor), "cold"
            if session is not None and reuse:
                source = self._restore(slot, session)
            if source == "cold" and slot.tokens and not (reuse and self.share_prefixes and slot.owner == owner):
                self._kv.clear_seq(slot.seq_id)
                slot.tokens = []
            slot.session, slot.owner = session, owner
        cached = min(common_prefix_len(slot.tokens, prompt), len(prompt) - 1) if reuse else 0
        if source == "cold":  # the free slot's leftover KV (another request's) may start with this prompt
            cached = cached if cached >= MIN_SHARED_TOKENS else 0
            source = "shared" if cached else "cold"
        shared = cached if source == "shared" else 0
        if donor is not None and donor is not slot:
            reach = min(common_prefix_len(donor.tokens, prompt), len(prompt) - 1)
            if reach - cached >= MIN_SHARED_TOKENS:
                cached = shared = self._copy(donor, slot, reach)
                source = "shared"
        self._kv.trim_seq(slot.seq_id, cached)
        slot.tokens = prompt[:cached]
        slot.last_used = time.monotonic()
        slot.busy = True
        return Acquired(slot, source, round((time.perf_counter() - t0) * 1000, 3), cached, shared)

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.planned = None
        slot.last_used = time.monotonic()

    def pause(self, slot: Slot) -> Paused:
        """Copy a running generation's KV out to RAM and free its slot (a copy of the KV in RAM costs a few ms;
        computing it again, seconds). The KV stays in the slot as its owner's leftover until another request
        takes the slot, so a resume into it copies nothing back."""
        held = Paused(slot.owner, slot.session, list(slot.tokens), self._kv.save_seq(slot.seq_id))
        slot.session = None
        self.release(slot)
        self.paused += 1
        return held

    def resume(self, held: Paused) -> Slot:
        """An idle slot holding ``held``'s KV again, busy (``idle()`` must be true)."""
        slot = self._take_slot(held.owner, held.tokens, None)
        if slot.tokens != held.tokens or slot.owner != held.owner:
            self._kv.clear_seq(slot.seq_id)
            slot.tokens = []
            if not self._kv.load_seq(slot.seq_id, held.state):
                raise ProtocolError(ErrorCode.INTERNAL, "a paused generation's KV could not be restored")
        slot.owner, slot.session, slot.tokens = held.owner, held.session, list(held.tokens)
        slot.busy, slot.last_used = True, time.monotonic()
        self.paused -= 1
        return slot

    def forget_paused(self) -> None:
        """A paused generation ended without resuming (cancelled)."""
        self.paused -= 1

    def _donor(self, owner: str, prompt: list[int]) -> Slot | None:
        mine = [s for s in self.slots if s.owner == owner]
        best = max(mine, key=lambda s: common_prefix_len(s.tokens, prompt), default=None)
        return best if best is not None and common_prefix_len(best.tokens, prompt) >= MIN_SHARED_TOKENS else None

    def _take_slot(self, owner: str, prompt: list[int], donor: Slot | None) -> Slot:
        """A free slot (the one whose leftover KV, if the owner's, matches the prompt best), else the least
        recently used idle one, parked first; the donor stays resident while another idle slot can go."""
        idle = [s for s in self.slots if not s.busy]
        free = [s for s in idle if s.session is None]
        if free:
            return max(free, key=lambda s: (common_prefix_len(s.tokens, prompt) if s.owner == owner else 0,
                                            -s.last_used))
        victim = min([s for s in idle if s is not donor] or idle, key=lambda s: s.last_used)
        self._park(victim)
        return victim

    def _restore(self, slot: Slot, session: SessionKey) -> str:
        """Bring a parked (RAM) or saved (disk) session into ``slot``; its source, or "cold" if it has none."""
        parked = self._parked.pop(session, None)
        source = "restored"
        if parked is not None:
            self.parked_bytes -= len(parked.state)
        elif self._store is not None and (saved := self._store.load(stored_name(session))) is not None:
            parked, source = _Parked(*saved), "disk"
        if parked is None:
            return "cold"
        self._kv.clear_seq(slot.seq_id)
        if self._kv.load_seq(slot.seq_id, parked.state):
            slot.tokens = parked.tokens
            return source
        self._kv.clear_seq(slot.seq_id)
        slot.tokens = []
        return "cold"

    def _copy(self, donor: Slot, slot: Slot, n: int) -> int:
        """Copy the first ``n`` tokens' KV of ``donor`` into ``slot``; how many it holds after."""
        self._kv.clear_seq(slot.seq_id)
        if not self._kv.load_seq(slot.seq_id, self._kv.save_seq(donor.seq_id)):
            self._kv.clear_seq(slot.seq_id)
            slot.tokens = []
            return 0
        slot.tokens = donor.tokens[:n]
        return n

    def _park(self, slot: Slot) -> None:
        if self.park_budget_bytes > 0 and slot.session is not None and slot.tokens:
            state = self._kv.save_seq(slot.seq_id)
            if len(state) <= self.park_budget_bytes:
                self._parked[slot.session] = _Parked(list(slot.tokens), state)
                self.parked_bytes += len(state)
                while self.parked_bytes > self.park_budget_bytes:
                    _, evicted = self._parked.popitem(last=False)
                    self.parked_bytes -= len(evicted.state)
        self._kv.clear_seq(slot.seq_id)
        slot.session, slot.owner, slot.tokens = None, None, []

    def persist(self) -> int:
        """Write every session's KV (resident and parked) to the store, for after a restart; how many."""
        if self._store is None:
            return 0
        saved = 0
        for slot in self.slots:
            if slot.session is not None and slot.tokens and not slot.busy:
                saved += self._store.save(stored_name(slot.session), slot.tokens, self._kv.save_seq(slot.seq_id))
        for session, parked in self._parked.items():
            saved += self._store.save(stored_name(session), parked.tokens, parked.state)
        return saved

    def drop(self, session: SessionKey) -> bool:
        """Forget a session's KV wherever it lives (not while it generates); True if there was any."""
        found = False
        for slot in self.slots:
            if slot.session == session and not slot.busy:
                self._kv.clear_seq(slot.seq_id)
                slot.session, slot.owner, slot.tokens = None, None, []
                found = True
        parked = self._parked.pop(session, None)
        if parked is not None:
            self.parked_bytes -= len(parked.state)
            found = True
        if self._store is not None:
            found = self._store.drop(stored_name(session)) or found
        return found

    def describe(self, session: SessionKey | None) -> dict:
        """Totals, plus where ``session``'s own KV lives: never other sessions' ids (they are capabilities)."""
        resident = {s.session: len(s.tokens) for s in self.slots if s.session is not None}
        if session in resident:
            mine = {"where": "resident", "tokens": resident[session]}
        elif session in self._parked:
            mine = {"where": "parked", "tokens": len(self._parked[session].tokens)}
        elif session is not None and self._store is not None and self._store.has(stored_name(session)):
            mine = {"where": "disk", "tokens": None}
        else:
            mine = {"where": "none", "tokens": 0}
        return {"slots": len(self.slots), "resident": len(resident), "parked": len(self._parked),
                "parked_mb": round(self.parked_bytes / 2**20, 2), "session": mine}


def stored_name(session: SessionKey) -> str:
    """The name a session is saved under: its owner's and its own (the store hashes it)."""
    owner, session_id = session
    return f"{owner}\0{session_id}"
