"""Message matching without sockets: (peer, tag) keys, FIFO per key, MPI's non-overtaking rule."""

import random

from plait.comm.transport.matching import Matcher


def test_receives_posted_first_are_taken_in_posting_order():
    m = Matcher()
    assert m.post((1, 7), "r0") is None
    assert m.post((1, 7), "r1") is None
    assert m.is_posted((1, 7))
    assert m.take((1, 7)) == "r0"
    assert m.take((1, 7)) == "r1"
    assert m.take((1, 7)) is None
    assert not m.is_posted((1, 7))


def test_unexpected_messages_wait_in_arrival_order_and_are_not_copied():
    m = Matcher()
    first, second = bytearray(b"first"), bytearray(b"second")
    assert m.take((0, 3)) is None  # nobody asked: the engine buffers it...
    assert m.arrived((0, 3), first) is None  # ...and keeps it once whole
    assert m.arrived((0, 3), second) is None
    assert m.has_unexpected((0, 3))
    assert m.post((0, 3), "r0") is first
    assert m.post((0, 3), "r1") is second
    assert not m.has_unexpected((0, 3))
    assert not m.is_posted((0, 3))  # both receives were satisfied, none waits


def test_a_receive_posted_while_its_message_streams_in_gets_it_when_whole():
    m = Matcher()
    assert m.take((2, 0)) is None  # the header came before any receive
    assert m.post((2, 0), "late") is None  # the payload is still arriving
    assert m.arrived((2, 0), bytearray(4)) == "late"
    assert not m.has_unexpected((2, 0)) and not m.is_posted((2, 0))


def test_keys_are_independent_by_peer_and_by_tag():
    m = Matcher()
    m.post((0, 1), "peer0-tag1")
    m.post((1, 1), "peer1-tag1")
    m.post((0, 2), "peer0-tag2")
    assert m.take((1, 2)) is None
    assert m.take((0, 2)) == "peer0-tag2"
    assert m.take((1, 1)) == "peer1-tag1"
    assert m.take((0, 1)) == "peer0-tag1"


def test_waits_on_and_drain():
    m = Matcher()
    m.post((0, 1), "a")
    m.post((2, 5), "b")
    m.post((0, 4), "c")
    assert m.waits_on(0) and m.waits_on(2) and not m.waits_on(1)
    assert sorted(m.drain()) == ["a", "b", "c"]
    assert not m.waits_on(0) and not m.waits_on(2)
    assert m.take((0, 1)) is None


def test_random_interleavings_pair_the_kth_receive_with_the_kth_message_of_its_key():
    # the reference is MPI's rule stated by counting, not a queue: per key, the k-th
    # receive posted gets the k-th message sent, whatever the interleaving
    rng = random.Random(12)
    for _ in range(200):
        m = Matcher()
        keys = [(p, t) for p in range(2) for t in range(2)]
        sent = {k: 0 for k in keys}
        posted = {k: 0 for k in keys}
        got: dict[tuple, bytearray] = {}  # receive name -> what it got
        for _ in range(40):
            k = rng.choice(keys)
            if rng.random() < 0.5:
                name = (k, posted[k])
                posted[k] += 1
                data = m.post(k, name)
                if data is not None:
                    got[name] = data
            else:
                msg = bytearray(f"{k}:{sent[k]}".encode())
                sent[k] += 1
                req = m.take(k)  # the header arrives
                if req is None:
                    req = m.arrived(k, msg)  # buffered: whole now
                if req is not None:
                    got[req] = msg
        for (k, i), data in got.items():
            assert data.decode() == f"{k}:{i}"
        for k in keys:  # everything that could meet did
            assert len([n for n in got if n[0] == k]) == min(sent[k], posted[k])
