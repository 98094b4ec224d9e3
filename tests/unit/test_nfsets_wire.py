"""cni.policy.nfsets on the wire: an element list as the kernel carries it (the same nesting in an add and in a
dump's answer) reads back as the keys it was made of, and bytes that are not well-formed never make the reading
raise or hand out more than the message holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cni.dataplane import nlwire
from cni.policy import nfsets

keys = st.lists(st.binary(min_size=1, max_size=16), max_size=40)


@settings(max_examples=200, deadline=None)
@given(keys)
def test_the_keys_of_an_element_list_read_back_in_order(ks: list[bytes]) -> None:
    data, answered = nfsets.batch(nfsets.NFPROTO_INET, "t", {"q4": ks})
    msgs = [m for t, _, _, m in nlwire.messages(data) if t & 0xFF == nfsets.NFT_MSG_NEWSETELEM]
    assert len(msgs) == len(answered) == (1 if ks else 0)
    assert [k for m in msgs for k in nfsets.keys_of(m)] == list(dict.fromkeys(ks))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_bytes_that_are_not_an_element_list_give_no_more_than_they_hold(junk: bytes) -> None:
    msg = nlwire.message(0x0A0C, 0, 1, b"\x01\x00\x00\x00" + junk)
    got = nfsets.keys_of(msg)
    assert sum(len(k) for k in got) <= len(junk)


def test_the_dump_request_names_the_table_and_set() -> None:
    req = nfsets.get_elements(nfsets.NFPROTO_INET, "nodeplug-quarantine", "q6", 7)
    _, msg_type, flags, seq, _ = nlwire.NLMSGHDR.unpack_from(req, 0)
    assert (msg_type, flags, seq) == ((10 << 8) | 13, nlwire.NLM_F_REQUEST | nlwire.NLM_F_DUMP, 7)
    body = {k: req[a:b] for k, a, b in nlwire.attrs(req, nlwire.NLMSGHDR.size + 4)}
    assert body == {1: b"nodeplug-quarantine\0", 2: b"q6\0"}
    assert req[nlwire.NLMSGHDR.size] == nfsets.NFPROTO_INET
