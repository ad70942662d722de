"""The parameter server's state machine, message by message, without sockets.

Each test feeds `Server.handle` the requests a worker would send and checks the replies it
lets go: to whom, in answer to which request, with which values and versions. Expected
values are written out by hand (SGD without momentum: value - lr * gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.ps.config import PSConfig
from plait.ps.server import Reply, Server
from plait.ps.sharding import ParamSpec, specs_to_json
from plait.ps.wire import Message

SPECS = [ParamSpec("w", (4,), torch.float32)]  # one parameter: one key, 0


def _server(workers: int, **options: Any) -> Server:
    """A configured server (worker 0's init done) holding zeros for key 0."""
    cfg = PSConfig(**{"lr": 0.5, "momentum": 0.0, "worker_timeout_s": 5.0, **options})
    server = Server(0, workers, 1, lambda: (cfg, specs_to_json(SPECS)))
    replies = server.handle("w0", Message("init", 1, 0, [0], [torch.zeros(4)]), 0.0)
    assert _summary(replies) == [("w0", "ok", 1)]
    return server


def _push(worker: int, rid: int, clock: int, grad: list[float], version: int) -> Message:
    """A push_pull as Client sends it: its clock after the push, the version it pulled."""
    g = torch.tensor(grad, dtype=torch.float32)
    return Message("push_pull", rid, worker, [0], [g], [version], clock=clock)


def _summary(replies: list[Reply]) -> list[tuple[Any, str, int]]:
    return [(origin, m.op, m.rid) for origin, m in replies]


def _value(reply: Reply) -> tuple[list[float], int]:
    """(the value of key 0, its version) in a pull's reply."""
    msg = reply[1]
    assert msg.op == "ok" and msg.keys == [0], msg
    return msg.tensors[0].tolist(), msg.versions[0]


def _stats(server: Server, worker: int = 0) -> dict[str, Any]:
    (reply,) = server.handle(f"w{worker}", Message("stats", 99, worker), 0.1)
    return reply[1].meta


def test_sync_round_answers_every_worker_with_the_mean() -> None:
    server = _server(2, mode="sync")
    assert server.handle("w0", _push(0, 2, 1, [1, 2, 3, 4], 0), 0.1) == []  # round open
    replies = server.handle("w1", _push(1, 2, 1, [3, 2, 1, 0], 0), 0.1)
    assert _summary(replies) == [("w0", "ok", 2), ("w1", "ok", 2)]
    for r in replies:  # 0 - 0.5 * mean([1,2,3,4], [3,2,1,0]) = -1 everywhere
        assert _value(r) == ([-1.0] * 4, 1)
    assert _stats(server)["updates"] == 1


def test_sync_push_of_the_next_step_waits_for_the_round() -> None:
    server = _server(2, mode="sync")
    server.handle("w0", Message("push", 2, 0, [0], [torch.ones(4)], [0], clock=1), 0.1)
    # worker 0's next push arrives before worker 1's first: it must not join round 1
    assert server.handle("w0", _push(0, 3, 2, [2, 2, 2, 2], 0), 0.1) == []
    assert len(server.deferred) == 1
    replies = server.handle("w1", _push(1, 2, 1, [3, 3, 3, 3], 0), 0.1)
    # round 1 applied (mean 2: value -1), then worker 0's deferred push opens round 2
    assert _summary(replies) == [("w1", "ok", 2)]
    assert _value(replies[0]) == ([-1.0] * 4, 1)
    assert server.deferred == [] and _stats(server)["updates"] == 1


def test_async_applies_each_push_at_once() -> None:
    server = _server(2, mode="async")
    (r,) = server.handle("w0", _push(0, 2, 1, [1, 1, 1, 1], 0), 0.1)
    assert _value(r) == ([-0.5] * 4, 1)
    (r,) = server.handle("w1", _push(1, 2, 1, [2, 2, 2, 2], 0), 0.1)  # computed on version 0
    assert _value(r) == ([-1.5] * 4, 2)
    stats = _stats(server)
    assert (stats["applied"], stats["max_staleness"], stats["sum_staleness"]) == (2, 1, 1)


def test_ssp_holds_a_pull_beyond_the_bound_until_the_slowest_catches_up() -> None:
    server = _server(2, mode="ssp", staleness=1)
    (r,) = server.handle("w0", _push(0, 2, 1, [1, 1, 1, 1], 0), 0.1)  # clocks (1, 0): 1 <= 1
    assert _value(r) == ([-0.5] * 4, 1)
    assert server.handle("w0", _push(0, 3, 2, [1, 1, 1, 1], 1), 0.2) == []  # (2, 0): 2 > 1
    assert server.tick(0.3) == []  # time alone does not release it
    # worker 1's first push (clocks (2, 1)) is applied, then lets worker 0's pull go
    replies = server.handle("w1", Message("push", 2, 1, [0], [torch.ones(4)], [0], clock=1), 0.4)
    assert _summary(replies) == [("w1", "ok", 2), ("w0", "ok", 3)]
    assert _value(replies[1]) == ([-1.5] * 4, 3)


def test_ssp_does_not_wait_for_a_worker_that_pushes_no_more() -> None:
    """Worker 0 out of slices (staying to report) holds no one back: counting its clock,
    `plait train --ps-mode ssp` hung when a faster worker had claimed every slice left."""
    server = _server(2, mode="ssp", staleness=0)
    assert server.handle("w1", _push(1, 2, 1, [1, 1, 1, 1], 0), 0.1) == []  # (0, 1): 1 > 0
    replies = server.handle("w0", Message("hb", 7, 0, meta={"idle": True}), 0.2)
    assert _summary(replies) == [("w0", "ok", 7), ("w1", "ok", 2)]
    assert _value(replies[1]) == ([-0.5] * 4, 1)


def test_stale_push_is_dropped_beyond_the_bound() -> None:
    server = _server(2, mode="async", stale_policy="drop", drop_bound=0)
    server.handle("w0", _push(0, 2, 1, [1, 1, 1, 1], 0), 0.1)
    (r,) = server.handle("w1", _push(1, 2, 1, [8, 8, 8, 8], 0), 0.1)  # staleness 1 > 0
    assert _value(r) == ([-0.5] * 4, 1)  # unchanged: not applied, not versioned
    stats = _stats(server)
    assert (stats["applied"], stats["dropped"]) == (1, 1)


def test_stale_push_is_scaled_by_its_staleness() -> None:
    server = _server(2, mode="async", stale_policy="scale")
    server.handle("w0", _push(0, 2, 1, [1, 1, 1, 1], 0), 0.1)  # -0.5
    server.handle("w0", _push(0, 3, 2, [1, 1, 1, 1], 1), 0.1)  # -1.0
    (r,) = server.handle("w1", _push(1, 2, 1, [4, 4, 4, 4], 0), 0.1)  # staleness 2: lr 0.25
    assert _value(r) == ([-2.0] * 4, 3)


def test_pull_returns_the_current_version_and_waits_for_init() -> None:
    cfg = PSConfig(mode="async", lr=0.5, momentum=0.0)
    server = Server(0, 2, 1, lambda: (cfg, specs_to_json(SPECS)))
    assert server.handle("w1", Message("pull", 1, 1), 0.0) == []  # before worker 0's init
    replies = server.handle("w0", Message("init", 1, 0, [0], [torch.full((4,), 2.0)]), 0.0)
    assert _summary(replies) == [("w0", "ok", 1), ("w1", "ok", 1)]
    assert _value(replies[1]) == ([2.0] * 4, 0)
    for rid in (2, 3, 4):
        server.handle("w0", Message("push", rid, 0, [0], [torch.ones(4)], [0], clock=rid), 0.1)
    (r,) = server.handle("w1", Message("pull", 2, 1), 0.2)
    assert _value(r) == ([0.5] * 4, 3)  # 2 - 3 * 0.5, after 3 updates


def test_resent_push_is_acknowledged_not_applied_again() -> None:
    server = _server(1, mode="async")
    push = Message("push", 2, 0, [0], [torch.ones(4)], [0], clock=1)
    assert _summary(server.handle("w0", push, 0.1)) == [("w0", "ok", 2)]
    assert _summary(server.handle("w0", push, 0.2)) == [("w0", "ok", 2)]
    assert _stats(server)["updates"] == 1


def test_bad_requests_get_an_error_reply() -> None:
    server = _server(1, mode="async")
    wrong = Message("push", 2, 0, [0], [torch.ones(3)], [0], clock=1)  # key 0 holds 4
    ((origin, m),) = server.handle("w0", wrong, 0.1)
    assert (origin, m.op, m.rid, m.meta["error"]) == ("w0", "error", 2, "bad_request")
    assert "shape [4]" in m.meta["reason"]
    bare = Message("push", 3, 0, [0], [], [0], clock=1)  # keys but no tensor frame
    ((origin, m),) = server.handle("w0", bare, 0.1)  # an error reply, not a crashed server
    assert (m.op, m.meta["reason"]) == ("error", "0 tensors for 1 keys")
    ((origin, m),) = server.reject("x", "header is not valid msgpack")
    assert (origin, m.op, m.meta["error"]) == ("x", "error", "bad_request")
    assert m.meta["inc"] == server.incarnation  # every reply names the incarnation


def test_a_worker_heard_before_the_init_gets_the_timeout_not_the_start_up_grace() -> None:
    cfg = PSConfig(lr=0.5, momentum=0.0, worker_timeout_s=5.0, mode="async")
    server = Server(0, 2, 1, lambda: (cfg, specs_to_json(SPECS)))
    # worker 1 overtakes worker 0's init: its pull waits, then goes once the init is in
    assert server.handle("w1", Message("pull", 1, 1, [0]), 0.0) == []
    replies = server.handle("w0", Message("init", 1, 0, [0], [torch.zeros(4)]), 0.5)
    assert _summary(replies) == [("w0", "ok", 1), ("w1", "ok", 1)]
    assert server.tick(4.9) == [] and server.cons is not None
    server.tick(5.2)  # worker 1 silent since 0.0 for over 5 s (the grace would be 30 s)
    assert server.cons.dead() == [1]
    assert server.cons.dead_reason[1] == "no message or heartbeat for 5.2 s"
    server.tick(5.6)  # worker 0 was heard at its init (0.5): silent 5.1 s
    assert server.cons.dead() == [0, 1]


def test_silent_worker_fails_a_sync_pull_with_its_rank() -> None:
    server = _server(2, mode="sync")
    server.handle("w1", Message("hb", 1, 1), 0.0)
    assert server.handle("w0", _push(0, 2, 1, [1, 1, 1, 1], 0), 1.0) == []
    assert server.tick(4.0) == []  # worker 1 silent for 4 s < 5 s
    ((origin, m),) = server.tick(6.0)
    assert (origin, m.op, m.rid, m.meta["error"], m.meta["rank"]) == (
        "w0", "error", 2, "peer_failure", 1)  # fmt: skip
