"""Hostile input, generated: random bytes and random envelopes against the decoder and the live service.

Bounded for CI (``FUZZ_EXAMPLES``, default 300 for the decoder, a third of that live);
the longer run is ``FUZZ_EXAMPLES=20000 bash scripts/test tests/shared/test_fuzz.py``. The
number of inputs tried is printed in the test summary.
"""

import math
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.client import Client
from shared.protocol import MESSAGES, PROTOCOL_VERSION, ErrorCode, ProtocolError, decode_request
from tests.conftest import FUZZ_COUNTS

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
KNOWN_CODES = {v for k, v in vars(ErrorCode).items() if k.isupper()}
HANDLED = set(MESSAGES)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
    st.sampled_from([-5, -1, 0, 1, 2, 8, 10**12]), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=64), st.binary(max_size=64), st.just("x" * 70000),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)), max_leaves=30)
# Nesting far deeper than msgpack's packer allows, written as raw bytes: {"body": {"body": ... {}}}
deep = st.integers(1, 5000).map(lambda n: (b"\x81" + msgpack.packb("body")) * n + b"\x80")


def body_for(msg_type):
    """Bodies that mostly use the type's own field names, with values of any type."""
    names = list(MESSAGES[msg_type].fields) or ["x"]
    return st.dictionaries(st.sampled_from(names + ["unknown"]), values, max_size=len(names) + 1)


envelopes = st.sampled_from(sorted(HANDLED) + ["nope"]).flatmap(lambda t: st.fixed_dictionaries({
    "v": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, "1", None]),
    "id": st.one_of(st.text(min_size=1, max_size=40), scalars),
    "type": st.one_of(st.just(t), scalars),
    "session": st.one_of(st.none(), st.text(max_size=40), scalars),
    "body": st.one_of(body_for(t) if t in MESSAGES else values, values),
}))


def packed(env):
    return msgpack.packb(env, use_bin_type=True)


frames = st.one_of(st.binary(max_size=2048), deep, envelopes.map(packed),
                   envelopes.map(packed).map(lambda b: b[: max(1, len(b) // 2)]))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames)
def test_decoder_accepts_or_raises_typed_error(frame):
    FUZZ_COUNTS["decoder"] = FUZZ_COUNTS.get("decoder", 0) + 1
    try:
        req = decode_request(frame, max_frame_bytes=1 << 20, handled=HANDLED)
    except ProtocolError as err:
        assert err.code in KNOWN_CODES and err.message
        return
    assert isinstance(req.body, dict) and req.type in HANDLED
    for value in req.body.values():
        assert not (isinstance(value, float) and not math.isfinite(value))


@pytest.mark.model
def test_live_service_answers_every_hostile_frame(inference_service):
    client = Client(inference_service.endpoint, timeout_s=60)
    live_frames = st.one_of(frames, envelopes.filter(lambda e: e["type"] in MESSAGES).map(packed))

    @settings(max_examples=max(EXAMPLES // 3, 20), deadline=None, suppress_health_check=list(HealthCheck))
    @given(live_frames)
    def one(frame):
        FUZZ_COUNTS["live"] = FUZZ_COUNTS.get("live", 0) + 1
        client.send_raw(frame)
        while True:  # a valid streaming request may send events first; a timeout here fails the test
            reply = client.recv_reply(timeout_s=60)
            if reply.final:
                break
        assert reply.kind == "ok" or reply.error_code in KNOWN_CODES

    try:
        one()
        assert client.health()["ok"]
    finally:
        client.close()
