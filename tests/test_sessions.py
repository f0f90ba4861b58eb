import pytest

from services.inference.sessions import SessionTable
from shared.protocol import ProtocolError


class FakeKv:
    """Records KV operations; a parked state is the token list encoded as bytes."""

    def __init__(self):
        self.seqs = {}
        self.ops = []

    def save_seq(self, seq_id):
        self.ops.append(("save", seq_id))
        return bytes(self.seqs.get(seq_id, [])) * 10

    def load_seq(self, seq_id, state):
        self.ops.append(("load", seq_id))
        self.seqs[seq_id] = list(state[: len(state) // 10])
        return True

    def clear_seq(self, seq_id):
        self.seqs[seq_id] = []


def use(table, kv, session, tokens):
    got = table.acquire(session)
    got.slot.tokens = list(tokens)
    kv.seqs[got.slot.seq_id] = list(tokens)
    table.release(got.slot)
    return got


def test_same_session_stays_resident():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    assert use(t, kv, "a", [1, 2]).source == "cold"
    got = t.acquire("a")
    assert got.source == "resident" and got.slot.tokens == [1, 2]
    t.release(got.slot)


def test_lru_session_is_parked_and_restored():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "a", [1, 2, 3])
    use(t, kv, "b", [4, 5])
    use(t, kv, "c", [6])  # evicts a (least recently used)
    assert t.describe("a")["session"] == {"where": "parked", "tokens": 3} and ("save", 0) in kv.ops
    got = t.acquire("a")  # evicts b, restores a
    assert got.source == "restored" and got.slot.tokens == [1, 2, 3]
    assert t.describe("a")["session"]["where"] == "resident" and t.describe("c")["session"]["where"] == "resident"
    assert t.describe("b")["session"]["where"] == "parked" and t.describe(None)["parked"] == 1


def test_park_budget_evicts_oldest():
    kv = FakeKv()
    t = SessionTable(1, 45, kv)  # room for one parked state of 3 tokens (30 bytes)
    use(t, kv, "a", [1, 2, 3])
    use(t, kv, "b", [4, 5, 6])
    use(t, kv, "c", [7])
    assert t.describe("b")["session"]["where"] == "parked" and t.describe(None)["parked"] == 1
    assert t.parked_bytes <= 45
    assert t.acquire("a").source == "cold"


def test_stateless_requests_are_always_cold():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, None, [1, 2])
    assert t.acquire(None).source == "cold" and t.acquire(None).slot.tokens == []


def test_drop_forgets_everywhere():
    kv = FakeKv()
    t = SessionTable(1, 1 << 20, kv)
    use(t, kv, "a", [1])
    use(t, kv, "b", [2])
    assert t.drop("a") and t.drop("b") and not t.drop("a")
    assert t.describe(None)["resident"] == 0 and t.describe(None)["parked"] == 0


def test_busy_slots_are_never_taken_or_parked():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    a = t.acquire("a")  # generating
    use(t, kv, "b", [4])
    assert not t.can_admit("a")  # a's own slot is busy: a second request of a must wait
    use(t, kv, "c", [5])  # evicts idle b, never busy a
    assert a.slot.session == "a" and t.describe("b")["session"]["where"] == "parked"
    t.acquire("c")
    assert not t.can_admit("d") and not t.can_admit(None)
    with pytest.raises(ProtocolError):
        t.acquire("d")
