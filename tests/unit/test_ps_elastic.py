"""Workers that leave and join a parameter-server job (PSConfig(elastic_workers=True)),
message by message, without sockets: the servers' round rules (consistency.py) and the
joiner's admission by every server (join.py).

Values are written out by hand as in test_ps_server.py: SGD without momentum, lr 0.5, one
key of 4 zeros, so a round's value is -0.5 * the mean of its gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.ps.config import PSConfig
from plait.ps.errors import JobOverError
from plait.ps.join import admit
from plait.ps.request import error_of
from plait.ps.server import Reply, Server
from plait.ps.sharding import ParamSpec, specs_to_json
from plait.ps.wire import Message

SPECS = [ParamSpec("w", (4,), torch.float32)]


def _server(workers: int, mode: str = "sync", **options: Any) -> Server:
    """A configured server (worker 0's init done) holding zeros for key 0."""
    options = {"lr": 0.5, "momentum": 0.0, "worker_timeout_s": 5.0, "elastic_workers": True,
               **options}  # fmt: skip
    cfg = PSConfig(mode=mode, **options)
    server = Server(0, workers, 1, lambda: (cfg, specs_to_json(SPECS)))
    server.handle("w0", Message("init", 1, 0, [0], [torch.zeros(4)]), 0.0)
    return server


def _push(worker: int, rid: int, clock: int, grad: float, op: str = "push_pull") -> Message:
    return Message(op, rid, worker, [0], [torch.full((4,), grad)], [0], clock=clock)


def _join(worker: int, rid: int, wanted: int | None = None) -> Message:
    return Message("join", rid, worker, meta={} if wanted is None else {"clock": wanted})


def _ok(replies: list[Reply]) -> dict[Any, Message]:
    """Each reply by its origin; all must be "ok"."""
    assert all(m.op == "ok" for _, m in replies), [(o, m.op, m.meta) for o, m in replies]
    return {origin: m for origin, m in replies}


def _value(msg: Message) -> float:
    values = msg.tensors[0].tolist()
    assert len(set(values)) == 1
    return float(values[0])


def test_a_round_closes_over_the_live_workers_when_one_dies_without_pushing() -> None:
    server = _server(3)
    assert server.handle("w0", _push(0, 2, 1, 1.0), 1.0) == []
    assert server.handle("w1", _push(1, 2, 1, 3.0), 1.0) == []  # waits for worker 2
    server.handle("w2", Message("hb", 0, 2), 1.0)  # worker 2 heard last at 1.0, then silent
    for w in (0, 1):
        server.handle(f"w{w}", Message("hb", 0, w), 5.0)
    assert server.tick(5.9) == []
    got = _ok(server.tick(6.1))  # worker 2 dead: the round is worker 0's and 1's
    assert sorted(got) == ["w0", "w1"] and _value(got["w0"]) == -0.5 * 2.0
    assert got["w0"].meta["members"] == [0, 1] and got["w0"].meta["next"] == [0, 1]
    assert server.cons is not None and server.cons.sync_failure() is None
    got = _ok(server.handle("w0", _push(0, 3, 2, 2.0), 6.2))  # alone with worker 1: no wait
    assert got == {}
    got = _ok(server.handle("w1", _push(1, 3, 2, 2.0), 6.2))
    assert _value(got["w1"]) == -1.0 - 0.5 * 2.0 and got["w1"].meta["round"] == 2


def test_a_dead_workers_gradient_already_in_the_round_counts() -> None:
    server = _server(3)
    assert _ok(server.handle("w2", _push(2, 2, 1, 6.0, "push"), 0.5)).keys() == {"w2"}
    assert server.handle("w0", _push(0, 2, 1, 0.0), 0.5) == []
    server.handle("w0", Message("hb", 0, 0), 5.0)
    server.handle("w1", Message("hb", 0, 1), 5.0)
    assert server.tick(5.6) == [] and server.cons is not None and server.cons.dead() == [2]
    got = _ok(server.handle("w1", _push(1, 2, 1, 3.0), 5.7))  # mean of 6, 0, 3: 3
    assert _value(got["w0"]) == -0.5 * 3.0 and got["w0"].meta["members"] == [0, 1, 2]
    assert got["w0"].meta["next"] == [0, 1]


def test_without_elastic_workers_no_worker_joins() -> None:
    server = _server(2, elastic_workers=False)
    ((_, m),) = server.handle("w2", _join(2, 1), 0.1)
    assert m.op == "error" and "elastic_workers=True" in str(m.meta["reason"])
    assert "members" not in _ok(server.handle("w1", Message("pull", 1, 1), 0.1))["w1"].meta


def test_a_joiner_is_a_member_from_the_round_after_the_next() -> None:
    server = _server(2)
    assert server.handle("w0", _push(0, 2, 1, 1.0), 0.1) == []  # round 1 is open
    # a heartbeat before its join is answered and changes nothing; anything else is refused
    assert _ok(server.handle("w2", Message("hb", 0, 2), 0.1)).keys() == {"w2"}
    ((_, m),) = server.handle("w2", Message("pull", 1, 2), 0.1)
    assert m.op == "error" and "worker 2 is not in [0, 2)" in str(m.meta["reason"])
    joined = _ok(server.handle("w2", _join(2, 2), 0.2))
    assert joined["w2"].meta["clock"] == 1  # last closed round 0 + 1: first push is clock 2
    assert server.handle("w2", Message("pull", 3, 2, clock=1), 0.2) == []  # after round 1
    got = _ok(server.handle("w1", _push(1, 2, 1, 3.0), 0.3))  # round 1 without the joiner
    assert sorted(got) == ["w0", "w1", "w2"] and _value(got["w2"]) == -1.0
    assert got["w0"].meta["members"] == [0, 1] and got["w0"].meta["next"] == [0, 1, 2]
    assert server.handle("w0", _push(0, 3, 2, 2.0), 0.4) == []
    assert server.handle("w1", _push(1, 3, 2, 2.0), 0.4) == []  # round 2 waits for it
    got = _ok(server.handle("w2", _push(2, 4, 2, 5.0), 0.5))  # mean of 2, 2, 5: 3
    assert _value(got["w2"]) == -1.0 - 0.5 * 3.0 and got["w2"].meta["members"] == [0, 1, 2]


def test_a_joiner_may_ask_for_a_later_clock_until_it_pushes() -> None:
    server = _server(2)
    assert _ok(server.handle("w3", _join(3, 1), 0.1))["w3"].meta["clock"] == 1
    assert _ok(server.handle("w3", _join(3, 2, wanted=4), 0.1))["w3"].meta["clock"] == 4
    for rid, clock in ((2, 1), (3, 2), (4, 3)):  # rounds 1-3 close without it
        server.handle("w0", _push(0, rid, clock, 1.0), 0.2)
        assert len(_ok(server.handle("w1", _push(1, rid, clock, 1.0), 0.2))) == 2
    # asking for a clock whose round's members are fixed already: the server's own answer
    assert _ok(server.handle("w3", _join(3, 3, wanted=2), 0.3))["w3"].meta["clock"] == 4
    got = _ok(server.handle("w3", Message("pull", 4, 3, clock=4), 0.3))
    assert got == {}  # it waits for round 4: its first is round 5
    server.handle("w0", _push(0, 5, 4, 1.0), 0.4)
    assert len(_ok(server.handle("w1", _push(1, 5, 4, 1.0), 0.4))) == 3  # its pull goes too
    server.handle("w3", _push(3, 5, 5, 1.0), 0.5)  # its first push
    for worker, rid in ((3, 6), (0, 6)):  # pushed: its id is taken; a first worker's always
        ((_, m),) = server.handle(f"w{worker}", _join(worker, rid), 0.5)
        assert m.op == "error" and "is taken" in str(m.meta["reason"])


def test_every_reply_of_a_round_names_the_members_fixed_when_it_closed() -> None:
    """A joiner's first pull, answered after a death was seen, still names the next round's
    members as the round's close fixed them: every worker plans that round alike."""
    server = _server(3)
    assert _ok(server.handle("w3", _join(3, 1), 0.1))["w3"].meta["clock"] == 1
    server.handle("w0", _push(0, 2, 1, 1.0), 0.2)
    server.handle("w1", _push(1, 2, 1, 1.0), 0.2)
    got = _ok(server.handle("w2", _push(2, 2, 1, 1.0), 0.2))  # round 1 closes
    assert {m.meta["next"] == [0, 1, 2, 3] for m in got.values()} == {True}
    for w in (0, 1, 3):
        server.handle(f"w{w}", Message("hb", 0, w), 5.0)
    server.tick(5.5)  # worker 2 silent since 0.2: dead
    assert server.cons is not None and server.cons.dead() == [2]
    late = _ok(server.handle("w3", Message("pull", 3, 3, clock=1), 5.6))["w3"]
    assert (late.meta["round"], late.meta["next"]) == (1, [0, 1, 2, 3])
    server.handle("w0", _push(0, 3, 2, 1.0), 5.7)
    server.handle("w1", _push(1, 3, 2, 1.0), 5.7)
    got = _ok(server.handle("w3", _push(3, 4, 2, 1.0), 5.7))  # round 2: no worker 2
    assert got["w3"].meta["members"] == [0, 1, 3] and got["w3"].meta["next"] == [0, 1, 3]


def test_a_joiner_after_the_last_round_is_told_the_job_is_over() -> None:
    server = _server(2)
    for w in (0, 1):
        server.handle(f"w{w}", _push(w, 2, 1, 1.0), 0.1)
    assert _ok(server.handle("w2", _join(2, 1), 0.2))["w2"].meta["clock"] == 2
    assert server.handle("w2", Message("pull", 2, 2, clock=2), 0.2) == []  # waits: round 2
    assert [o for o, _ in server.handle("w0", Message("bye", 3, 0), 0.3)] == ["w0"]
    (_, ok), (origin, m) = server.handle("w1", Message("bye", 3, 1), 0.3)  # the last one
    assert ok.op == "ok" and origin == "w2" and m.meta["error"] == "job_over"
    assert "no live worker is left to close round 2" in str(m.meta["reason"])
    assert isinstance(error_of(0, m), JobOverError)  # what the joiner's Client raises
    assert not server.finished()  # until the joiner says goodbye
    server.handle("w2", Message("bye", 5, 2), 0.5)
    assert server.finished()


def test_in_ssp_a_joiner_starts_at_the_slowest_live_clock() -> None:
    server = _server(2, "ssp", staleness=1)
    for rid, clock in ((2, 1), (3, 2), (4, 3)):
        server.handle("w0", _push(0, rid, clock, 0.0, "push"), 0.1)
    server.handle("w1", _push(1, 2, 1, 0.0, "push"), 0.1)
    server.handle("w1", _push(1, 3, 2, 0.0, "push"), 0.1)
    assert _ok(server.handle("w2", _join(2, 1), 0.2))["w2"].meta["clock"] == 2  # min(3, 2)
    assert _ok(server.handle("w2", Message("pull", 2, 2, clock=2), 0.2)).keys() == {"w2"}
    assert server.handle("w0", Message("pull", 5, 0, clock=3), 0.2) != []  # 3 - 2 <= 1
    server.handle("w0", _push(0, 6, 4, 0.0, "push"), 0.3)
    assert server.handle("w0", Message("pull", 7, 0, clock=4), 0.3) == []  # 4 - 2 > 1
    server.handle("w1", _push(1, 4, 3, 0.0, "push"), 0.4)
    assert server.cons is not None and not server.cons.pull_ready(0)  # the joiner holds it
    replies = server.handle("w2", _push(2, 3, 3, 0.0, "push"), 0.5)
    assert [(o, m.rid) for o, m in replies] == [("w2", 3), ("w0", 7)]


def test_a_join_before_worker_0s_init_is_answered_after_it() -> None:
    cfg = PSConfig(lr=0.5, momentum=0.0, elastic_workers=True)
    server = Server(0, 2, 1, lambda: (cfg, specs_to_json(SPECS)))
    assert server.handle("w2", _join(2, 1), 0.0) == []
    replies = server.handle("w0", Message("init", 1, 0, [0], [torch.zeros(4)]), 0.1)
    assert [(o, m.op, m.meta.get("clock")) for o, m in replies] == [
        ("w0", "ok", None), ("w2", "ok", 1)]  # fmt: skip


class _Wire:
    """A transport that hands each request to its Server at once (join.admit's view)."""

    def __init__(self, servers: list[Server], worker: int) -> None:
        self.servers, self.worker, self.asked = servers, worker, []

    def submit_all(self, requests: list[tuple[int, Message, Any, int]]) -> list[int]:
        for s, msg, callback, _ in requests:
            msg.rid, msg.worker = len(self.asked) + 1, self.worker
            self.asked.append((s, msg.meta.get("clock")))
            for _, reply in self.servers[s].handle("joiner", msg, 1.0):
                callback(s, reply)
        return []

    def alive(self) -> bool:
        return True


@pytest.mark.parametrize("mode,want", [("sync", 2), ("async", 1)])
def test_the_servers_agree_on_a_joiners_first_clock(mode: str, want: int) -> None:
    """Server 0 has closed round 1 and server 1 not yet (its last member's push is on the
    way): they answer 2 and 1; asked again for 2, both take it. In async each answers the
    slowest clock it knows (1 and 0) and takes the largest."""
    servers = [_server(2, mode), _server(2, mode)]
    for w in (0, 1):
        servers[0].handle(f"w{w}", _push(w, 2, 1, 1.0), 0.5)
    servers[1].handle("w0", _push(0, 2, 1, 1.0), 0.5)
    wire = _Wire(servers, 2)
    assert admit(wire, 2, timeout_s=5.0) == want  # type: ignore[arg-type]
    assert wire.asked == [(0, None), (1, None), (0, want), (1, want)]
    for s in servers:
        assert s.cons is not None and s.cons.first[2] == want + 1
