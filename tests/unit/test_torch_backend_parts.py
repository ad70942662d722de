"""The torch backend's parts that need no peer: how torch's reduce ops and call forms
translate, PlaitWork's futures (a failure fails the future for real, never through
set_exception), and the registration."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from plait.comm.core.request import Future
from plait.comm.torch_backend import registration
from plait.comm.torch_backend.translate import Reduction, is_async, reduction, tensors
from plait.comm.torch_backend.work import PlaitWork, Waiter
from plait.errors import PeerFailureError

R = dist.ReduceOp


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (R.SUM, "sum"),
        (R.AVG, "avg"),
        (R.PRODUCT, "prod"),
        (R.MIN, "min"),
        (R.MAX, "max"),
        (R.BAND, "band"),
        (R.BOR, "bor"),
        (R.BXOR, "bxor"),
    ],
)
def test_reduce_ops_map_to_plaits(op: object, name: str) -> None:
    red = Reduction(op)
    assert red.op == name and red.factor is None
    t = torch.ones(2)
    assert red.premultiply(t, in_place=False) is t


def test_premul_sum_is_a_sum_after_multiplying() -> None:
    for factor, expect in ((0.5, 0.5), (torch.tensor(3.0), 3.0)):
        red = Reduction(dist._make_nccl_premul_sum(factor))
        assert red.op == "sum"
        t = torch.full((3,), 2.0)
        copy = red.premultiply(t, in_place=False)
        assert torch.equal(copy, torch.full((3,), 2.0 * expect)) and t[0] == 2.0
        red.premultiply(t, in_place=True)
        assert torch.equal(t, copy)


def test_options_and_call_forms() -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = R.MAX
    assert reduction(opts).op == "max" and reduction(None).op == "sum"
    assert reduction(R.MIN).op == "min"  # the user form pg.allreduce(t, op=...)
    assert is_async(opts) and is_async(None)
    opts.asyncOp = False
    assert not is_async(opts)
    t = torch.ones(1)
    assert tensors(t) == [t] and tensors([t]) == [t]
    with pytest.raises(ValueError, match="one tensor per call"):
        tensors([t, t])
    with pytest.raises(ValueError, match="no reduce op"):
        Reduction("median")


def test_bitwise_ops_refuse_floats() -> None:
    from plait.comm.core.ops import check_op, reduce_into

    with pytest.raises(ValueError, match="integer or bool"):
        check_op("bor", torch.float32)
    acc = torch.tensor([0b1100, 0b1010])
    reduce_into(acc, torch.tensor([0b1010, 0b0110]), "bxor")
    assert acc.tolist() == [0b0110, 0b1100]


def test_a_finished_work_and_its_future() -> None:
    out = [torch.ones(2)]
    work = PlaitWork(None, out)
    assert work.wait() and work.is_completed() and work.is_success()
    assert work.get_future().wait() == out
    assert work.result() == out


def test_a_future_completes_on_the_finishing_thread_not_in_wait() -> None:
    req: Future[list[torch.Tensor]] = Future()
    out = [torch.zeros(1)]
    work = PlaitWork(req, out)
    fut = work.get_future()
    seen: list[str] = []
    chained = fut.then(lambda f: seen.append(threading.current_thread().name) or f.value())
    assert not fut.done() and not work.is_completed()
    finisher = threading.Thread(target=req.finish, args=(out,), name="call-thread")
    finisher.start()
    finisher.join()
    assert fut.done() and seen == ["call-thread"]  # nobody waited: it completed by itself
    assert chained.wait() == out


def test_a_failure_fails_the_future_for_real() -> None:
    """torch's Future.set_exception would store the error as a successful value (torch
    2.13), and DDP would read tensors out of it; the Work's future must really fail."""
    req: Future[list[torch.Tensor]] = Future()
    work = PlaitWork(req, [torch.zeros(1)])
    fut = work.get_future()
    err = PeerFailureError(1, "connection closed (process died)", seen_by=0)
    req.finish(None, err)
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        fut.wait()
    with pytest.raises(PeerFailureError):  # a Python caller of wait() gets plait's type
        work.wait()
    assert work.is_completed() and not work.is_success() and work.exception() is err
    failed = PlaitWork.failed(err)
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        failed.get_future().wait()


def test_a_waiter_completes_futures_of_other_requests() -> None:
    class Slow:
        def __init__(self) -> None:
            self.event = threading.Event()

        def wait(self) -> None:
            self.event.wait(5)

        def done(self) -> bool:
            return self.event.is_set()

        def synchronize(self) -> None:
            self.wait()

    waiter = Waiter("test-waiter")
    req = Slow()
    work = PlaitWork(req, [torch.ones(1)], waiter)  # type: ignore[arg-type]
    fut = work.get_future()
    assert not fut.done()
    req.event.set()
    assert fut.wait()[0].item() == 1.0
    waiter.stop()
    assert not any(t.name == "test-waiter" for t in threading.enumerate())


def test_registration_is_idempotent() -> None:
    registration.register()
    registration.register()
    plugin = dist.Backend._plugins["PLAIT"]
    assert plugin.extended_api
    assert dist.Backend.default_device_backend_map.get("cpu") == "gloo"  # unchanged
    assert dist.Backend.backend_capability["plait"] == ["cpu", "cuda"]  # not "c", "p", "u"


def test_observer_records_steps_and_the_compute_inside_them() -> None:
    from plait.comm.torch_backend.observe import Observer
    from plait.trace.recorder import Recorder

    rec = Recorder(0)
    observer = Observer(rec)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
        with torch.no_grad():
            model(torch.randn(2, 3))  # a forward with no backward: no backward span
    finally:
        observer.remove()
    model(torch.randn(2, 3)).sum().backward()  # removed: nothing more recorded
    names = [(cat, name) for cat, name, *_ in rec.events]
    one_step = [("compute", "forward"), ("compute", "backward"), ("compute", "optimizer")]
    assert names == [*one_step, ("step", "step 0"), *one_step, ("step", "step 1"),
                     ("compute", "forward")]  # fmt: skip
    steps = [(start, end) for cat, _, start, end, *_ in rec.events if cat == "step"]
    forwards = [start for cat, name, start, *_ in rec.events if name == "forward"]
    assert steps[0][0] == forwards[0] and steps[1][0] == steps[0][1]  # steps tile the run


def test_the_backend_stand_in_answers_what_torch_asks() -> None:
    from plait.comm.torch_backend.process_group import BackendStandIn

    backend = BackendStandIn()
    assert not backend.supports_splitting and not backend.supports_coalescing
    assert not backend.supports_tensor_alloc(torch.device("cpu")) and backend.name() == "plait"
    backend._set_sequence_number_for_group()


def test_a_job_torch_started_needs_no_master_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_process_group(init_method="file://..." or "tcp://...", rank=, world_size=) sets
    no MASTER_ADDR/MASTER_PORT (torch's own test suite inits so): the master is the
    TCPStore's host, else loopback; torch's rank and size win over the environment's."""
    from datetime import timedelta

    from plait.comm.bootstrap.rendezvous import world_of_torch
    from plait.comm.bootstrap.store import tcp_host

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "7")
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    assert tcp_host(dist.PrefixStore("a/", dist.PrefixStore("b/", tcp))) == "127.0.0.1"
    assert tcp_host(dist.HashStore()) is None
    world = world_of_torch(1, 3, "10.1.2.3")
    assert (world.rank, world.size, world.master_addr) == (1, 3, "10.1.2.3")
    assert world_of_torch(0, 2, None).master_addr == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    assert world_of_torch(0, 2, "10.1.2.3").master_addr == "10.9.9.9"


def test_failures_are_runtime_errors_as_torchs_backends_are() -> None:
    """gloo and NCCL raise DistBackendError (a RuntimeError): `except RuntimeError` in code
    written for them catches plait's failures too, which keep their own types."""
    from plait.errors import CollectiveMismatchError, CommTimeoutError

    for err in (
        PeerFailureError(1, "connection closed"),
        CommTimeoutError("waited"),
        CollectiveMismatchError(["a", "b"], "ops differ"),
    ):
        assert isinstance(err, RuntimeError), type(err)
    assert isinstance(CommTimeoutError("waited"), TimeoutError)
