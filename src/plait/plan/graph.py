"""A task graph run on queues: FlexFlow's execution simulator, reduced to what plait needs.

Jia, Zaharia & Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks" (SysML
2019), section 5: every task (a layer's forward on a device, a transfer over a link) has a
duration and runs on one queue; a task starts when every task it depends on has finished
and its queue is free. Here a queue is a *resource*: a rank's compute, or a link. When a
resource falls idle it takes, among its ready tasks, the one with the lowest `priority`
(then the one added first), which is how the simulated runtime orders, say, gradient
buckets. Tasks that must keep an order on their resource (a pipeline stage's actions)
depend on the one before.

Everything is deterministic: ties break by insertion order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    resource: str
    duration: float
    priority: float = 0.0
    deps: list[int] = field(default_factory=list)
    cat: str = ""  # what kind of work ("forward", "send", "reduce" ...): fit.py's categories


@dataclass
class Run:
    """When each task ran (`spans[i]` = (start, end)), and how long each resource was busy."""

    spans: list[tuple[float, float]]
    busy: dict[str, float]

    @property
    def makespan(self) -> float:
        return max((end for _, end in self.spans), default=0.0)


class Graph:
    """Tasks on resources, with dependencies; `run()` times them."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(
        self, name: str, resource: str, duration: float, deps: list[int] | None = None,
        priority: float = 0.0, cat: str = "",
    ) -> int:  # fmt: skip
        """Add a task of category `cat`; returns its id (the index to give later tasks'
        `deps`)."""
        if duration < 0:
            raise ValueError(f"task {name}: duration {duration} < 0")
        self.tasks.append(Task(name, resource, duration, priority, list(deps or []), cat))
        return len(self.tasks) - 1

    def run(self, scale: dict[str, float] | None = None) -> Run:
        """Simulate; `scale[resource]` multiplies the durations of that resource's tasks
        (0 to make a link free)."""
        scale = scale or {}
        n = len(self.tasks)
        waiting = [len(t.deps) for t in self.tasks]
        users: list[list[int]] = [[] for _ in range(n)]
        for i, t in enumerate(self.tasks):
            for d in t.deps:
                users[d].append(i)
        ready: dict[str, list[tuple[float, int]]] = {}
        idle: dict[str, bool] = {}
        busy: dict[str, float] = {}
        spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
        events: list[tuple[float, int]] = []  # (end time, task)
        for i, t in enumerate(self.tasks):
            idle.setdefault(t.resource, True)
            busy.setdefault(t.resource, 0.0)
            if not waiting[i]:
                heapq.heappush(ready.setdefault(t.resource, []), (t.priority, i))
        now, done = 0.0, 0

        def dispatch() -> None:
            for r, queue in ready.items():
                if idle[r] and queue:
                    _, i = heapq.heappop(queue)
                    t = self.tasks[i]
                    took = t.duration * scale.get(r, 1.0)
                    spans[i] = (now, now + took)
                    busy[r] += took
                    idle[r] = False
                    heapq.heappush(events, (now + took, i))

        dispatch()
        while events:
            now, i = heapq.heappop(events)
            finished = [i]
            while events and events[0][0] == now:  # everything ending now, before dispatching
                finished.append(heapq.heappop(events)[1])
            for i in finished:
                done += 1
                idle[self.tasks[i].resource] = True
                for u in users[i]:
                    waiting[u] -= 1
                    if not waiting[u]:
                        t = self.tasks[u]
                        heapq.heappush(ready.setdefault(t.resource, []), (t.priority, u))
            dispatch()
        if done != n:
            stuck = [self.tasks[i].name for i in range(n) if waiting[i]][:5]
            raise ValueError(f"task graph has a cycle: {', '.join(stuck)} never start")
        return Run(spans, busy)
