"""Running a collective call: its order, its thread, its row of the routing table, and the
`auto` choice of that row.

    routes.py       the routing table: (collective, algorithm) -> the row, joined from the
                    algorithm modules (their rows, ON_DEVICE and COSTS)
    auto.py         algorithm="auto": the cost model's choice among the usable rows
    calibration.py  the calibration file `auto` reads (plait bench collectives --calibrate)
    agreement.py    the cross-rank check that every rank made the same call
    call_thread.py  the one thread that runs a communicator's async calls, in order
    runner.py       Runner (call numbering, the hand-off to the call thread) and each call's
                    CallContext (streams, shared memory, the gloo and NCCL groups)
"""
