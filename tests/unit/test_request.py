"""plait.Request, the one type async calls return: its two implementations, without sockets."""

import threading
import time

import pytest

import plait
from plait.comm.core.request import Transfer
from plait.comm.dispatch.call_thread import CallThread


class _Driver:
    """Stands for the engine: completes the request when asked to drive it."""

    def __init__(self, error=None):
        self.driven = 0
        self.error = error

    def drive(self, req):
        self.driven += 1
        req.complete(self.error)


def test_a_transfer_is_driven_only_if_not_done_and_raises_its_error():
    driver = _Driver()
    req = Transfer(driver, 1, memoryview(bytearray(4)))
    assert isinstance(req, plait.Request) and not req.done()
    assert req.wait() is None and driver.driven == 1
    req.wait()  # done: not driven again
    assert driver.driven == 1
    failing = Transfer(_Driver(plait.PeerFailureError(3, "gone")), 3, memoryview(b""))
    with pytest.raises(plait.PeerFailureError):
        failing.wait()


def test_a_parked_transfer_wakes_when_another_thread_completes_it():
    req = Transfer(_Driver(), 0, memoryview(b""))
    threading.Timer(0.05, req.complete).start()
    start = time.monotonic()
    req.park(5.0)
    assert req.done()
    assert time.monotonic() - start < 2.5  # woken, not timed out


def test_the_call_thread_runs_calls_in_order_and_hands_back_results_and_errors():
    thread = CallThread("test-thread")
    order = []
    gate = threading.Event()

    def first():
        gate.wait(5.0)
        order.append(1)
        return "one"

    def second():
        order.append(2)
        raise ValueError("bad input")

    try:
        a, b = thread.submit(first), thread.submit(second)
        assert isinstance(a, plait.Request) and not a.done() and not thread.idle
        gate.set()
        assert a.wait() == "one"
        with pytest.raises(ValueError, match="bad input"):
            b.wait()
        assert order == [1, 2]
        assert a.started_at <= a.finished_at <= b.started_at <= b.finished_at
    finally:
        thread.stop()
