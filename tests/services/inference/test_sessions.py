"""Session slots bookkeeping (SessionTable) with fake KV: reuse, parking, disk, shared prefixes."""

import pytest

from services.inference.session_store import SessionStore
from services.inference.sessions import MIN_SHARED_TOKENS, SessionTable, common_prefix_len, stored_name
from shared.protocol import ProtocolError

OWNER = "local"


def key(session):
    """A session id of OWNER as the table knows it."""
    return None if session is None else (OWNER, session)


class FakeKv:
    """Records KV operations; a saved state is the token list encoded as bytes."""

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

    def trim_seq(self, seq_id, keep):
        self.seqs[seq_id] = self.seqs.get(seq_id, [])[:keep]


def use(table, kv, session, tokens):
    """One request of ``session`` whose prompt is ``tokens``: acquire, 'prefill' everything, release."""
    got = table.acquire(OWNER, key(session), tokens)
    got.slot.tokens = list(tokens)
    kv.seqs[got.slot.seq_id] = list(tokens)
    table.release(got.slot)
    return got


LONG = list(range(1, 40))  # longer than MIN_SHARED_TOKENS


def test_common_prefix_len_across_its_64_token_blocks():
    a = list(range(200))
    assert common_prefix_len(a, a) == 200 and common_prefix_len(a, a[:70]) == 70
    assert common_prefix_len(a, a[:130] + [-1] + a[131:]) == 130 and common_prefix_len([], a) == 0


def test_same_session_stays_resident_and_keeps_its_prefix():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    assert use(t, kv, "a", [1, 2]).source == "cold"
    got = t.acquire(OWNER, key("a"), [1, 2, 3])
    assert got.source == "resident" and got.cached == 2 and got.slot.tokens == [1, 2]
    t.release(got.slot)


def test_the_last_prompt_token_is_always_evaluated_again():
    kv = FakeKv()
    t = SessionTable(1, 1 << 20, kv)
    use(t, kv, "a", [1, 2, 3])
    got = t.acquire(OWNER, key("a"), [1, 2, 3])  # the same prompt: its last token must be decoded for fresh logits
    assert got.cached == 2 and kv.seqs[got.slot.seq_id] == [1, 2]


def test_lru_session_is_parked_and_restored():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "a", [1, 2, 3])
    use(t, kv, "b", [4, 5])
    use(t, kv, "c", [6])  # evicts a (least recently used)
    assert t.describe(key("a"))["session"] == {"where": "parked", "tokens": 3} and ("save", 0) in kv.ops
    got = t.acquire(OWNER, key("a"), [1, 2, 3, 7])  # evicts b, restores a
    assert got.source == "restored" and got.cached == 3 and got.slot.tokens == [1, 2, 3]
    assert t.describe(key("a"))["session"]["where"] == "resident" and t.describe(key("c"))["session"]["where"] == "resident"
    assert t.describe(key("b"))["session"]["where"] == "parked" and t.describe(None)["parked"] == 1


def test_park_budget_evicts_oldest():
    kv = FakeKv()
    t = SessionTable(1, 45, kv)  # room for one parked state of 3 tokens (30 bytes)
    use(t, kv, "a", [1, 2, 3])
    use(t, kv, "b", [4, 5, 6])
    use(t, kv, "c", [7])
    assert t.describe(key("b"))["session"]["where"] == "parked" and t.describe(None)["parked"] == 1
    assert t.parked_bytes <= 45
    assert t.acquire(OWNER, key("a"), [1, 2, 3]).source == "cold"


def test_a_new_session_copies_a_shared_prefix_from_another_sequence():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "a", LONG + [100, 101])
    got = t.acquire(OWNER, key("b"), LONG + [200])
    assert got.source == "shared" and got.cached == got.shared == len(LONG)
    assert kv.seqs[got.slot.seq_id] == LONG and ("save", 0) in kv.ops  # copied, then the tail trimmed
    assert t.describe(key("a"))["session"] == {"where": "resident", "tokens": len(LONG) + 2}  # the donor is untouched


def test_short_overlaps_are_not_worth_a_copy_and_reuse_can_be_refused():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "a", LONG)
    short = t.acquire(OWNER, key("b"), LONG[:MIN_SHARED_TOKENS - 2] + [999])
    assert short.source == "cold" and short.cached == 0
    t.release(short.slot)
    refused = t.acquire(OWNER, key("c"), LONG + [5], reuse=False)  # parks the least recently used idle session first
    assert refused.cached == 0 and kv.seqs[refused.slot.seq_id] == []


def test_a_request_without_session_reuses_a_free_slots_leftover_kv():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, None, LONG + [1])
    got = t.acquire(OWNER, key(None), LONG + [2])
    assert got.source == "shared" and got.cached == len(LONG) and ("save", 0) not in kv.ops  # same slot: no copy


def test_waiting_for_a_prefix_that_is_being_prefilled():
    kv = FakeKv()
    t = SessionTable(3, 1 << 20, kv)
    leader = t.acquire(OWNER, key("a"), LONG + [1])
    leader.slot.planned = LONG + [1]
    assert t.worth_waiting(OWNER, LONG + [2])  # the leader will hold 39 shared tokens soon; nothing holds them now
    assert not t.worth_waiting(OWNER, list(range(500, 540)))  # nothing in common
    leader.slot.tokens = list(LONG)  # the prefix is in
    assert not t.worth_waiting(OWNER, LONG + [2])


def test_the_donor_is_not_parked_to_make_room():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "donor", LONG + [1])  # least recently used
    use(t, kv, "other", [7, 8, 9])
    got = t.acquire(OWNER, key("new"), LONG + [2])
    assert got.source == "shared" and t.describe(key("other"))["session"]["where"] == "parked"
    assert t.describe(key("donor"))["session"]["where"] == "resident"


def test_stateless_requests_without_a_shared_prefix_are_cold():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, None, [1, 2])
    got = t.acquire(OWNER, key(None), [3, 4])
    assert got.source == "cold" and got.cached == 0 and got.slot.tokens == []


def test_drop_forgets_everywhere(tmp_path):
    kv = FakeKv()
    store = SessionStore(tmp_path, {"model": "m"}, 1 << 20)
    t = SessionTable(1, 1 << 20, kv, store)
    use(t, kv, "a", [1])
    use(t, kv, "b", [2])
    t.persist()
    assert store.has(stored_name(key("b"))) and t.describe(key("a"))["session"]["where"] == "parked"
    assert t.drop(key("a")) and t.drop(key("b")) and not t.drop(key("a")) and not store.has(stored_name(key("b")))
    assert t.describe(None)["resident"] == 0 and t.describe(None)["parked"] == 0


def test_sessions_saved_on_drain_come_back_from_disk(tmp_path):
    kv = FakeKv()
    t = SessionTable(1, 1 << 20, kv, SessionStore(tmp_path, {"model": "m"}, 1 << 20))
    use(t, kv, "a", [1, 2, 3])
    use(t, kv, "b", [4, 5])  # parks a
    assert t.persist() == 2
    fresh_kv = FakeKv()  # a new process: nothing resident, nothing parked
    fresh = SessionTable(1, 1 << 20, fresh_kv, SessionStore(tmp_path, {"model": "m"}, 1 << 20))
    assert fresh.describe(key("a"))["session"]["where"] == "disk"
    got = fresh.acquire(OWNER, key("a"), [1, 2, 3, 9])
    assert got.source == "disk" and got.cached == 3 and fresh_kv.seqs[got.slot.seq_id] == [1, 2, 3]


def test_busy_slots_are_never_taken_or_parked():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    a = t.acquire(OWNER, key("a"), [1])  # generating
    use(t, kv, "b", [4])
    assert not t.can_admit(key("a"))  # a's own slot is busy: a second request of a must wait
    use(t, kv, "c", [5])  # evicts idle b, never busy a
    assert a.slot.session == key("a") and t.describe(key("b"))["session"]["where"] == "parked"
    t.acquire(OWNER, key("c"), [5])
    assert not t.can_admit(key("d")) and not t.can_admit(None)
    with pytest.raises(ProtocolError):
        t.acquire(OWNER, key("d"), [1])


def test_kv_never_crosses_owners():
    """Another owner's prompt is neither a donor nor a free slot's leftover: what is cached for a guess is the
    same whether or not another tenant sent that prefix (the cross-session prompt probe)."""
    kv = FakeKv()
    t = SessionTable(3, 1 << 20, kv)
    secret = LONG + [42]
    use(t, kv, "alice-run", secret)  # alice's session holds the secret prefix
    t.release(use(t, kv, None, secret).slot)  # and a free slot holds it as a leftover
    for guess in (41, 42, 43):
        got = t.acquire("mallory", ("mallory", f"probe-{guess}"), LONG + [guess, 7])
        assert got.cached == 0 and got.source == "cold", guess
        assert kv.seqs[got.slot.seq_id] == []  # no leftover of alice's KV in what mallory got
        t.release(got.slot)
        t.drop(("mallory", f"probe-{guess}"))
    mine = t.acquire(OWNER, key("alice-next"), secret + [9])  # the owner itself still shares its prefix
    assert mine.cached == len(secret) and mine.source == "shared"


def test_a_session_id_names_a_session_of_its_owner_only():
    kv = FakeKv()
    t = SessionTable(2, 1 << 20, kv)
    use(t, kv, "run-1", LONG)
    theirs = t.acquire("other", ("other", "run-1"), LONG + [1])
    assert theirs.source == "cold" and theirs.cached == 0


def test_a_paused_generation_gets_its_kv_back_in_whatever_slot_is_free():
    kv = FakeKv()
    t = SessionTable(1, 1 << 20, kv)
    running = t.acquire(OWNER, key("s1"), LONG)
    kv.seqs[0] = running.slot.tokens = LONG + [99]  # it decoded a token
    held = t.pause(running.slot)
    assert t.paused == 1 and t.can_admit(key("other")) and t.resident(key("s1")) is None
    back = t.resume(held)  # nothing took the slot: its KV is still there, nothing is copied back
    assert back.tokens == LONG + [99] and back.session == key("s1") and back.busy and t.paused == 0
    assert ("load", 0) not in kv.ops
    held = t.pause(back)
    other = t.acquire("someone-else", None, [5, 6, 7])  # another owner takes the slot: its KV is cleared
    kv.seqs[0] = other.slot.tokens = [5, 6, 7]
    t.release(other.slot)
    back = t.resume(held)
    assert kv.seqs[0] == LONG + [99] and back.tokens == LONG + [99] and back.owner == OWNER and t.paused == 0
