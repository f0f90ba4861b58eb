from services.inference.text_stream import TextStream


def feed_all(stream, pieces):
    return [stream.feed(p) for p in pieces] + [stream.finish()]


def test_plain_text_passes_through():
    s = TextStream([])
    assert "".join(feed_all(s, [b"Hel", b"lo"])) == "Hello" == s.text


def test_split_utf8_is_held_until_complete():
    s = TextStream([])
    euro = "€".encode()
    out = feed_all(s, [euro[:1], euro[1:2], euro[2:], b"!"])
    assert out[0] == "" and out[1] == "" and out[2] == "€" and s.text == "€!"


def test_stop_sequence_cuts_and_is_not_emitted():
    s = TextStream(["\nObservation:"])
    out = feed_all(s, [b"Action: x", b"\nObs", b"ervation: y", b"more"])
    assert s.stopped and s.text == "Action: x" and "".join(out) == "Action: x"
    assert out[1] == ""  # "\nObs" might start the stop sequence: held back


def test_held_back_prefix_released_when_it_diverges():
    s = TextStream(["STOP"])
    assert s.feed(b"ST") == ""
    assert s.feed(b"AR") == "STAR"
    assert s.finish() == "" and not s.stopped
