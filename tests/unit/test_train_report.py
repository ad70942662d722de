"""What rank 0 shows: plain lines, and the `plait train` side of the event protocol."""

from __future__ import annotations

import io

from plait.train import progress

START = {
    "model": "mlp", "parameters": 1234, "data": "digits", "num_train": 10, "num_val": 5,
    "unit": "image", "workers": 2, "global_batch": 8, "steps": 20, "strategy": "allreduce",
    "optimizer": "sgd", "peak_lr": 0.05, "first_step": 0, "resumed_from": None,
}  # fmt: skip
FINISH = {
    "strategy": "allreduce", "world_size": 2, "steps": 20, "global_batch": 8,
    "final_loss": 0.25, "eval_name": "validation loss", "eval_value": 1.5,
    "eval_baseline": 3.1, "samples_per_s": 1000.0, "wall_s": 9.5, "final_loss_steps": 10,
    "eval_samples": 5, "unit": "window", "token": "byte", "eval_unit": "nats",
}  # fmt: skip
LOG = {"step": 10, "steps": 20, "loss": 0.5, "lr": 0.01, "samples_per_s": 900.0,
       "elapsed_s": 3.0}  # fmt: skip


def test_text_lines() -> None:
    out = io.StringIO()
    text = progress.Text(out)
    text.handle("start", START)
    text.handle("step", {"step": 1})  # nothing: only bars move per step
    text.handle("loss", LOG)  # nothing: between log points
    text.handle("log", LOG)
    text.handle("eval", {"step": 10, "name": "held-out accuracy", "value": 0.975,
                         "baseline": None, "eval_unit": "%"})  # fmt: skip
    text.handle(
        "eval",
        {"step": 10, "name": "validation mse", "value": 0.125, "baseline": None, "eval_unit": ""},
    )  # a workload's own metric
    text.handle("finish", FINISH)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("plait train: mlp (1,234 parameters) on digits")
    assert "2 workers x 4 = global batch 8" in lines[0]
    assert lines[1] == "step 10/20  loss 0.5000  lr 0.01  900 samples/s  3.0 s"
    assert lines[2] == "step 10: held-out accuracy 0.9750 (97.50%)"
    assert lines[3] == "step 10: validation mse 0.1250"
    body = "\n".join(lines[4:])
    assert "validation loss      1.5000 nats/byte (5 held-out windows)" in body
    assert "unigram baseline     3.1000 nats/byte" in body
    assert "final training loss  0.2500 (mean of the last 10 steps)" in body
    # --ps-mode async/ssp: the others may claim every slice; worker 0 has no loss, not nan
    idle = {**FINISH, "final_loss": float("nan"), "final_loss_steps": 0}
    none = "\n".join(progress.summary(idle))
    assert "final training loss  none: worker 0, which reports, trained no slice" in none


def test_events_round_trip_through_the_launchers_stream() -> None:
    wire = io.StringIO()
    events = progress.Events(wire, min_interval=0.0)
    for kind, rec in (("start", START), ("log", LOG), ("finish", FINISH)):
        events.handle(kind, rec)
    events.handle("error", {"message": "the training loss is nan at step 5", "code": 3})
    shown = io.StringIO()
    stream = progress.RankZeroStream(progress.Text(shown))
    for line in wire.getvalue().splitlines(keepends=True):
        stream.write("[rank 0] " + line)  # as the launcher's pump writes them
    stream.write("[rank 1] a warning from rank 1\n")
    stream.write("[rank 0] a plain print from rank 0\n")
    direct = io.StringIO()
    text = progress.Text(direct)
    for kind, rec in (("start", START), ("log", LOG), ("finish", FINISH)):
        text.handle(kind, rec)
    expected = direct.getvalue() + "[rank 1] a warning from rank 1\na plain print from rank 0\n"
    assert shown.getvalue() == expected
    assert stream.error == {"message": "the training loss is nan at step 5", "code": 3}


def test_step_events_are_rate_limited() -> None:
    wire = io.StringIO()
    events = progress.Events(wire, min_interval=60.0)
    for step in range(1, 100):
        events.handle("step", {"step": step})
    assert wire.getvalue().count(progress.MARK) == 1
