"""--trace for one run: recording starts on the run's communicator before the Step is
built, and ends, on every rank, when the run does; rank 0 writes the merged trace and its
metrics (plait.trace.metrics) join the run's figures (--json's "trace"). Parameter-server
workers record over the job's store instead (plait.trace.overstore; worker 0 merges). And
the model's per-block forward and backward events (`watch_blocks`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait import env, trace
from plait.comm import world
from plait.trace import overstore
from plait.train.errors import ConfigError

# the figures of a Step's --json that say each rank's memory (DataParallel and mesh runs:
# rank_memory; ZeRO: memory, its ranks)
MEMORY = ("rank_memory", "memory")


class Tracing:
    """One run's trace: nothing at all when `path` is None (recorder None)."""

    def __init__(self, group: Any, path: str | None) -> None:
        self.path, self.group = path, group
        self.recorder: trace.Recorder | None = None
        self.summary: dict[str, Any] | None = None
        self.owned = False  # started here (else PLAIT_TRACE's, which shutdown writes)
        self.done = False
        # --strategy ps: the workers share no Communicator, only the job's store (a Role)
        self.over_store = hasattr(group, "store") and hasattr(group, "num_workers")
        if path is None:
            return
        if self.over_store:
            self.recorder = overstore.start(group, path)
            self.owned = True
            return
        if not hasattr(group, "recorder"):
            raise ConfigError(
                f"--trace needs the run's ranks on a plait Communicator or a parameter-server "
                f"role; got a {type(group).__name__}"
            )
        self.recorder = group.recorder
        if self.recorder is None and world.joined():
            # joining a running elastic job (--elastic): the members aligned their clocks
            # when they started, and start() is a collective of theirs; one host's ranks
            # share a clock. Its events carry its launch id (RANK), which no member has
            self.recorder = trace.Recorder(int(os.environ.get("RANK", group.rank)))
            self.recorder.path = path
            group.recorder = self.recorder
            self.owned = True
        elif self.recorder is None:
            self.recorder = trace.start(group, path)
            self.owned = True

    def finish(
        self, options: dict[str, Any], figures: Callable[[], dict[str, Any]] | None = None
    ) -> None:
        """Every rank: gather and write the trace (rank 0); every rank gets its metrics.
        `figures`: the Step's --json figures (a collective, called on every rank), whose
        memory (MEMORY) joins the trace's otherData next to the options, for `plait plan
        --from-trace`; parameter-server runs report none."""
        if self.recorder is None or self.done:
            return
        self.done = True
        other: dict[str, Any] = {"options": options}
        if figures is not None and not self.over_store:
            found = figures()
            other.update({k: found[k] for k in MEMORY if k in found})
        if self.over_store:  # worker 0 merges; it alone reports, so it alone needs figures
            timeout_s = env.get("PLAIT_TIMEOUT")  # for a live worker's events
            doc = overstore.finish(self.group, self.path, {"options": options}, timeout_s)
            self.summary = doc["otherData"]["metrics"] if doc is not None else None
            return
        doc = trace.finish(self.group, self.path, other, detach=self.owned)
        metrics = doc["otherData"]["metrics"] if doc is not None else None
        self.summary = self.group.broadcast_object(metrics)  # the same figures everywhere

    def figures(self) -> dict[str, Any]:
        """--json's "trace": the metrics, without the per-step rows (those are in the file)."""
        if self.summary is None:
            return {}
        kept = {k: v for k, v in self.summary.items() if k != "per_step"}
        return {"trace": {"path": self.path, **kept}}

    def close(self) -> None:
        """After the run, or an error: stop recording (no collective: the peers may be gone)."""
        if self.owned and not self.done:
            self.group.recorder = None


def watch_blocks(model: nn.Module, rec: trace.Recorder | None) -> None:
    """While a trace records: "forward:<name>" and "backward:<name>" events for each
    top-level block of `model` (its children; a ModuleList's items one by one). Nothing
    at all when not recording: no hooks are registered.

    Forward: a pre-hook and a hook. Backward, with tensor hooks rather than module backward
    hooks (those wrap a module's outputs and break in-place operations after it): it begins
    when the gradient of the block's output is computed and ends when that of its input is,
    so a block whose input needs no gradient (the first, fed the data) has no backward
    event.
    """
    if rec is None:
        return
    for name, block in _blocks(model):
        began = [0.0, 0.0]  # forward's start, backward's start

        def pre(_m: nn.Module, args: Any, began: list[float] = began,
                label: str = f"backward:{name}") -> None:  # fmt: skip
            began[0] = trace.now()
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda _g: rec.complete("compute", label, began[1], trace.now()))

        def post(_m: nn.Module, _a: Any, out: Any, began: list[float] = began,
                 label: str = f"forward:{name}") -> None:  # fmt: skip
            rec.complete("compute", label, began[0], trace.now())
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _g: began.__setitem__(1, trace.now()))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level blocks: its children, containers' items one by one."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            out.append((name, child))
    return out
