"""Where each part of each stage gets its input from and sends its output to.

With `v` parts per stage (interleaved schedules) the model is cut into p*v *virtual stages*:
part j of rank r is virtual stage j*p + r (Megatron-LM's placement), so a micro-batch's
forward visits ranks 0..p-1 once per part, wrapping from the last rank back to rank 0. With
one part this is the plain pipeline: rank r's input comes from rank r-1.

`lanes_agree` checks what ordered transports need (NCCL matches messages between two ranks
by their order, not their tags; see plait.pipeline.p2p): between every pair of ranks the
messages go out in the order the receiver asks for them. The built schedules all pass it
(tests/unit/test_pipeline_schedule.py); `Pipeline` checks it on GPUs before it runs one.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.pipeline.schedule import Schedule, ScheduleError

Place = tuple[int, int]  # (rank, part)


@dataclass(frozen=True)
class Route:
    """The virtual-stage layout of `stages` ranks holding `parts` parts each."""

    stages: int
    parts: int = 1

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.parts

    def virtual(self, rank: int, part: int) -> int:
        """The virtual stage (position in the model) of `part` on `rank`."""
        return part * self.stages + rank

    def place(self, virtual: int) -> Place:
        """The (rank, part) holding virtual stage `virtual`."""
        return virtual % self.stages, virtual // self.stages

    def prev(self, rank: int, part: int) -> Place | None:
        """Where (rank, part)'s forward input comes from; None: the data (the first part)."""
        v = self.virtual(rank, part)
        return self.place(v - 1) if v > 0 else None

    def next(self, rank: int, part: int) -> Place | None:
        """Where (rank, part)'s forward output goes; None: the loss (the last part)."""
        v = self.virtual(rank, part)
        return self.place(v + 1) if v + 1 < self.virtual_stages else None


def _messages(schedule: Schedule, route: Route) -> tuple[dict, dict]:
    """Per (src, dst) rank pair: the messages in the order src sends them, and in the order
    dst receives them; a message is (kind, micro-batch, sending virtual stage)."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    wanted: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for acts in schedule:
        for a in acts:
            me = route.virtual(a.stage, a.part)
            if a.kind == "F":
                src, dst = route.prev(a.stage, a.part), route.next(a.stage, a.part)
                if src is not None:
                    wanted.setdefault((src[0], a.stage), []).append(("F", a.mb, me - 1))
                if dst is not None:
                    sent.setdefault((a.stage, dst[0]), []).append(("F", a.mb, me))
            elif a.kind == "B":
                src, dst = route.next(a.stage, a.part), route.prev(a.stage, a.part)
                if src is not None:
                    wanted.setdefault((src[0], a.stage), []).append(("B", a.mb, me + 1))
                if dst is not None:
                    sent.setdefault((a.stage, dst[0]), []).append(("B", a.mb, me))
    return sent, wanted


def lanes_agree(schedule: Schedule, route: Route) -> None:
    """Check that every rank pair's messages are sent in the order they are received.

    Raises:
        ScheduleError: naming the pair and the first message out of order.
    """
    sent, wanted = _messages(schedule, route)
    for pair in sorted(set(sent) | set(wanted)):
        out, into = sent.get(pair, []), wanted.get(pair, [])
        for i, (s, w) in enumerate(zip(out, into, strict=False)):
            if s != w:
                raise ScheduleError(
                    f"rank {pair[0]} -> rank {pair[1]}: message {i} is sent as {_name(s)} but "
                    f"received as {_name(w)}; an ordered transport (NCCL) would mix them up"
                )
        if len(out) != len(into):
            raise ScheduleError(
                f"rank {pair[0]} -> rank {pair[1]}: {len(out)} messages sent, {len(into)} received"
            )


def _name(message: tuple[str, int, int]) -> str:
    kind, mb, virtual = message
    what = "activation" if kind == "F" else "gradient"
    return f"micro-batch {mb}'s {what} from virtual stage {virtual}"
