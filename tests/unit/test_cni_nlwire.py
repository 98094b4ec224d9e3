"""The netlink wire walks: what is encoded reads back as it was, and bytes that are not well-formed never make a walk
raise or hand out a range outside the buffer."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from cni.dataplane import nlwire

attributes = st.lists(st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=40)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(attributes, st.binary(max_size=12))
def test_encoded_attributes_read_back_in_order(attrs: list[tuple[int, bytes]], prefix: bytes) -> None:
    data = prefix + b"".join(nlwire.attr(kind, value) for kind, value in attrs)
    got = [(kind, data[start:end]) for kind, start, end in nlwire.attrs(data, len(prefix))]
    assert got == [(kind & nlwire.NLA_TYPE_MASK, value) for kind, value in attrs]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.binary(max_size=60)), max_size=6))
def test_messages_of_a_datagram_read_back_with_their_bodies(msgs: list[tuple[int, int, bytes]]) -> None:
    datagram = b"".join(
        nlwire.message(t, f, seq, body) + b"\0" * (-len(body) % 4) for seq, (t, f, body) in enumerate(msgs, 1)
    )
    got = [(t, f, seq, bytes(m[nlwire.NLMSGHDR.size :])) for t, f, seq, m in nlwire.messages(datagram)]
    assert got == [(t, f, seq, body) for seq, (t, f, body) in enumerate(msgs, 1)]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 220))
def test_attribute_walk_stays_inside_any_bytes(data: bytes, offset: int) -> None:
    last = offset
    for kind, start, end in nlwire.attrs(data, offset):
        assert 0 <= kind <= nlwire.NLA_TYPE_MASK
        assert last + nlwire.NLATTR.size <= start <= end <= len(data)
        last = end


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_message_walk_stays_inside_any_bytes(data: bytes) -> None:
    covered = 0
    for _, _, _, msg in nlwire.messages(data):
        (length,) = struct.unpack_from("=I", msg)
        assert len(msg) == length >= nlwire.NLMSGHDR.size
        covered += nlwire.align(length)
    assert covered <= nlwire.align(len(data))


def test_a_length_past_the_end_stops_the_walk_there() -> None:
    good = nlwire.attr(1, b"abcd")
    bad = struct.pack("=HH", 200, 2) + b"xx"  # claims 200 bytes, has 6
    assert [(k, (good + bad)[s:e]) for k, s, e in nlwire.attrs(good + bad, 0)] == [(1, b"abcd")]
    first = nlwire.message(16, 0, 1, b"1234")
    cut = struct.pack("=IHHII", 64, 17, 0, 2, 0) + b"short"
    assert [(t, seq) for t, _, seq, _ in nlwire.messages(first + cut)] == [(16, 1)]
