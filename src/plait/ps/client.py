"""The worker API: a Client over a model's parameters with push, pull and push_pull.

    client = ps.Client(model.named_parameters(), cfg, role)
    loss.backward(); client.push_pull(None)        # send p.grad, receive the new values
    h = client.push_pull_async(None); ...; h.wait()

Every operation sends one request to every server (a server with no keys still gets it: it
keeps the worker's clock). A pull writes the served values into the parameters in place,
in `wait()`, on the calling thread. Until a push's handle is waited for, leave the
gradients alone: slices of large tensors are sent straight from their memory.

A model on a GPU works the same: its gradients are copied to pinned host buffers before a
push returns, and pulled values are copied back to the GPU on the caller's stream
(staging.py). The servers run on the CPU either way.

With PSConfig(priority=True) the servers answer a pull key by key in the order the model
consumes its parameters, and `wait_per_layer(model)` lets each layer's forward wait only
for its own values (TicTac), so the next forward starts before the whole pull is in:

    client.wait_per_layer(model)                   # once
    loss.backward(); client.push_pull_async(None)  # no wait: each layer waits for itself
    client.wait()                                  # every value written (before evaluating)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from plait import env, trace
from plait.comm.bootstrap.rendezvous import job_key, world_from_env
from plait.comm.bootstrap.store import barrier
from plait.comm.core.request import Request
from plait.ps.auth import frame_limit
from plait.ps.config import (
    STORE_ADMITTED,
    STORE_CONFIG,
    STORE_JOINED,
    STORE_PARAMS,
    PSConfig,
    store_server_key,
)
from plait.ps.consistency import Round
from plait.ps.errors import JobOverError, PSError
from plait.ps.join import admit
from plait.ps.request import ServerRequest
from plait.ps.roles import Role
from plait.ps.sharding import (
    Key,
    ParamSpec,
    Plan,
    gather,
    make_plan,
    scatter,
    specs_from_json,
    specs_to_json,
)
from plait.ps.staging import Staging
from plait.ps.transport import Transport
from plait.ps.wire import DTYPES, Message


class Client:
    """A worker's view of the parameter servers for `named_parameters`.

    Raises:
        PSError: parameters that differ from worker 0's (the first difference is named),
            or a dtype the wire does not carry; a joiner (role.joining) in a job started
            without PSConfig(elastic_workers=True).
        JobOverError: a joiner admitted after every other worker had finished or died.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter | torch.Tensor]],
        cfg: PSConfig,
        role: Role,
    ) -> None:
        named = list(named_parameters)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.role = role
        specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in named]
        for s in specs:
            if s.dtype not in DTYPES.values():
                raise PSError(f"parameter {s.name} is {s.dtype}; expected one of {list(DTYPES)}")
        store = role.store
        if role.rank == 0:
            store.set(STORE_PARAMS, specs_to_json(specs))
            store.set(STORE_CONFIG, cfg.to_json())
        else:
            _check_same(specs, specs_from_json(store.get(STORE_PARAMS)), role.rank)
            cfg = PSConfig.from_json(store.get(STORE_CONFIG))  # worker 0's is the job's
        if role.joining and not cfg.elastic_workers:
            raise PSError(
                f"worker {role.rank} cannot join: the job was started without "
                "PSConfig(elastic_workers=True)"
            )
        self.cfg = cfg
        self.plan: Plan = make_plan(specs, role.num_servers, cfg.slice_bytes)
        self._keys = [self.plan.keys_of(s) for s in range(role.num_servers)]
        self.versions = {k.key: 0 for k in self.plan.keys}
        self.clock = 0
        # plait.trace: "ps" push, pull and wait spans go to this recorder; the role's by
        # default (trace.overstore.start puts one there), or set one here
        self.recorder: trace.Recorder | None = role.recorder
        self._final_stats: dict[str, Any] | None = None
        self.round: Round | None = None  # elastic workers, sync: the last pulled values' round
        # a model on a GPU goes through pinned host copies; one on the CPU as it is
        on_gpu = any(p.device.type == "cuda" for p in self.params)
        self._staging = Staging(self.params) if on_gpu else None
        self._last_push: ServerRequest | None = None  # what last sent the staged gradients
        self._unwritten: ServerRequest | None = None  # the last pull, maybe not all written
        # the keys holding each parameter's elements (a layer waits for these: wait_per_layer)
        self._keys_of_param: list[set[int]] = [set() for _ in self.params]
        for k in self.plan.keys:
            for seg in k.segments:
                self._keys_of_param[seg.param].add(k.key)
        endpoints = [store.get(store_server_key(s)).decode() for s in range(role.num_servers)]
        # worker 0 hosts the store under `plait run`: it must not finish (and take the store
        # down) before the slowest worker has read it (a joiner comes later: not counted)
        try:
            if not role.joining:
                barrier(
                    store, STORE_JOINED, role.num_workers, env.get("PLAIT_INIT_TIMEOUT"), "workers"
                )
        except TimeoutError as e:
            raise PSError(f"{e}: every worker must create a ps.Client") from None
        self._transport = Transport(
            role.rank,
            endpoints,
            heartbeat_s=min(1.0, cfg.worker_timeout_s / 4),
            server_timeout_s=cfg.server_timeout_s,
            key=job_key(world_from_env()),
            max_frame_bytes=frame_limit(cfg.slice_bytes),
        )
        if role.rank == 0:
            with torch.no_grad():
                values = self._host_values()
                self._submit(
                    "init",
                    lambda s: [gather(self.plan, k, values) for k in self._keys[s]],
                    writes=False,
                ).wait()
        if role.joining:  # its first push is this clock + 1 (join.py)
            self.clock = admit(self._transport, role.num_servers, env.get("PLAIT_INIT_TIMEOUT"))
            store.add(STORE_ADMITTED, 1)  # (what a run that waits for a joiner reads)
        try:
            self.pull()  # every worker starts from the served values (worker 0's model)
        except JobOverError:  # a joiner after the last round: say goodbye, let servers end
            self.close()
            raise

    # -- the API --------------------------------------------------------------------------
    def push(self, grads: Iterable[torch.Tensor] | None = None, *, lr: float | None = None) -> None:
        """Send this step's gradients (None: each parameter's .grad); wait for the servers."""
        with trace.maybe(self.recorder, "ps", "push"):
            self._push("push", grads, lr).wait()

    def pull(self) -> None:
        """Write the newest values the consistency mode allows into the parameters."""
        with trace.maybe(self.recorder, "ps", "pull"):
            self._wait_written(self.pull_async())

    def push_pull(
        self, grads: Iterable[torch.Tensor] | None = None, *, lr: float | None = None
    ) -> None:
        """push(grads), then pull the values the next step may use."""
        with trace.maybe(self.recorder, "ps", "push"):  # a push, its pull riding along
            self._wait_written(self._push("push_pull", grads, lr))

    def push_async(
        self, grads: Iterable[torch.Tensor] | None = None, *, lr: float | None = None
    ) -> Request[None]:
        # traced: a "push" span over handing the gradients over (the transfer overlaps what
        # the caller does next; a later "wait" shows what is left of it)
        with trace.maybe(self.recorder, "ps", "push"):
            return self._push("push", grads, lr)

    def pull_async(self) -> Request[None]:
        return self._submit("pull", lambda s: [], writes=True)

    def push_pull_async(
        self, grads: Iterable[torch.Tensor] | None = None, *, lr: float | None = None
    ) -> Request[None]:
        with trace.maybe(self.recorder, "ps", "push"):  # as push_async
            return self._push("push_pull", grads, lr)

    def wait(self) -> None:
        """Finish the last pull: write every value not written yet (a no-op if none)."""
        if self._unwritten is not None:
            with trace.maybe(self.recorder, "ps", "wait"):
                self._wait_written(self._unwritten)

    def _wait_written(self, handle: Request[None]) -> None:
        handle.wait()
        # every value is written: the next wait() has nothing to do, and (tracing) records
        # no empty "wait" span inside each following push
        if self._unwritten is handle:
            self._unwritten = None

    def wait_per_layer(self, model: torch.nn.Module) -> list[Any]:
        """Let each submodule's forward wait only for its own parameters' pulled values.

        A forward pre-hook on every submodule that holds parameters of this client waits
        for (and writes) the keys holding them, of the last pull still unwritten; with
        PSConfig(priority=True) those of the first layers come first, so the next forward
        starts while the last layers' values are on the wire (TicTac's order). It assumes a
        parameter is read only inside its own module's forward (true of torch.nn layers);
        anything else must call wait() first. Returns the hooks' handles (to remove them).

        Raises:
            PSError: `model` holds none of this client's parameters.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        handles = []
        for module in model.modules():
            mine = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if not mine:
                continue
            keys = sorted(set().union(*(self._keys_of_param[i] for i in mine)))
            handles.append(module.register_forward_pre_hook(self._hook(keys)))
        if not handles:
            raise PSError(
                f"wait_per_layer: the model holds none of this client's {len(self.params)} "
                "parameters; pass the model whose named_parameters made the client"
            )
        return handles

    def _hook(self, keys: list[int]) -> Any:
        def wait_for_keys(module: torch.nn.Module, args: Any) -> None:
            pending, rec = self._unwritten, self.recorder
            if pending is None:
                return
            if rec is None:
                pending.wait_keys(keys)
                return
            start = trace.now()  # traced: a layer's wait is a "wait" inside its forward
            pending.wait_keys(keys)
            rec.complete("ps", "wait", start, trace.now(), {"keys": len(keys)})

        return wait_for_keys

    def save(self, generation: int, step: int) -> None:
        """Worker 0: have every server write its part of generation `generation` of the
        job's checkpoint (PSConfig.run_dir; run_checkpoint.py) after step `step`, once the
        last pull is written (in sync mode every server then holds that step's values, and
        no later ones: this worker has not pushed again); wait until each has.

        Raises:
            PSError: a server could not write its file (the reason names it).
        """
        meta = {"generation": generation, "step": step}
        self._submit("save", lambda s: [], writes=False, meta=meta).wait()

    def stats(self) -> dict[str, Any]:
        """Staleness and failure counts over all servers (every worker's gradients)."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        h = self._submit("stats", lambda s: [], writes=False)
        h.wait()
        metas = [r.meta for _, r in h.replies() if isinstance(r, Message)]
        applied = sum(int(m.get("applied", 0)) for m in metas)
        return {
            "max_staleness": max((int(m.get("max_staleness", 0)) for m in metas), default=0),
            "mean_staleness": sum(int(m.get("sum_staleness", 0)) for m in metas) / max(1, applied),
            "max_clock_staleness": max(
                (int(m.get("max_clock_staleness", 0)) for m in metas), default=0
            ),
            "mean_clock_staleness": sum(int(m.get("sum_clock_staleness", 0)) for m in metas)
            / max(1, applied),
            "dropped_gradients": sum(int(m.get("dropped", 0)) for m in metas),
            "applied_gradients": applied,
            "bytes_per_server": self.plan.bytes_per_server,
            "lost_updates": sum(self._transport.lost),
            "dead_workers": sorted({w for m in metas for w in m.get("dead", [])}),
            "updates_per_server": [
                int(r.meta.get("updates", 0)) for _, r in h.replies() if isinstance(r, Message)
            ],
        }

    def close(self) -> None:
        """Say goodbye to every server (after reading the final stats)."""
        if self._final_stats is not None:
            return
        try:
            self._final_stats = self.stats()
        except Exception:
            self._final_stats = {}
        try:
            self._submit("bye", lambda s: [], writes=False).wait()
        finally:
            self._transport.close()

    # -- internals ------------------------------------------------------------------------
    def _submit(
        self,
        op: str,
        tensors: Any,
        *,
        writes: bool,
        lr: float | None = None,
        with_versions: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> ServerRequest:
        # a pull still being written finishes first: its values are what this request's
        # gradients were computed from, and two pulls must not write in turn
        self.wait()
        n = self.role.num_servers
        keys_of = [[k.key for k in ks] for ks in self._keys]
        handle = ServerRequest(n, self._transport, self._write if writes else None, keys_of)
        requests = []
        for s in range(n):
            keys = keys_of[s] if op != "pull" else []
            msg = Message(
                op,
                keys=keys,
                tensors=tensors(s),
                versions=[self.versions[k] for k in keys] if with_versions else [],
                lr=lr,
                clock=self.clock,
                meta=dict(meta or {}),
            )
            if op in ("stats", "bye", "hb", "save"):
                msg.keys = []
            # P3's priority: the consumption index of the first key it carries (keys are
            # numbered in registration order); all equal without priority: FIFO
            first = keys_of[s][0] if keys_of[s] else len(self.plan.keys)
            requests.append((s, msg, handle.reply, first if self.cfg.priority else 0))
        self._transport.submit_all(requests)
        if writes:
            self._unwritten = handle
        return handle

    def _push(
        self, op: str, grads: Iterable[torch.Tensor] | None, lr: float | None
    ) -> ServerRequest:
        flat = self._grads(grads)
        if self._staging is not None:
            last = self._last_push
            flat = self._staging.grads(flat, reuse=last is None or last.done())
        self.clock += 1
        handle = self._submit(
            op,
            lambda s: [gather(self.plan, k, flat) for k in self._keys[s]],
            writes=op == "push_pull",
            lr=None if lr is None else float(lr),
            with_versions=True,
        )
        self._last_push = handle
        return handle

    def _host_values(self) -> list[torch.Tensor]:
        """The parameters' values in host memory (the model's own tensors on the CPU)."""
        if self._staging is not None:
            return self._staging.targets()  # copied from the GPU when the staging was made
        return [p.detach() for p in self.params]

    def _grads(self, grads: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
        if grads is None:
            out = []
            for n, p in zip(self.names, self.params, strict=True):
                if p.grad is None:
                    raise PSError(
                        f"parameter {n} has no .grad: call backward() first, or pass "
                        "the gradients to push"
                    )
                out.append(p.grad)
            return out
        out = list(grads)
        if len(out) != len(self.params):
            raise PSError(
                f"expected {len(self.params)} gradients (one per parameter, in "
                f"named_parameters order); got {len(out)}"
            )
        for n, p, g in zip(self.names, self.params, out, strict=True):
            if g.shape != p.shape or g.dtype != p.dtype:
                raise PSError(
                    f"gradient of {n}: expected {p.dtype} {list(p.shape)}; got "
                    f"{g.dtype} {list(g.shape)}"
                )
        return [g.detach() for g in out]

    def _write(self, server: int, reply: Message) -> None:
        mine = {k.key: k for k in self._keys[server]}
        targets = self.params if self._staging is None else self._staging.targets()
        written: list[Key] = []
        with torch.no_grad():
            for i, (k, t) in enumerate(zip(reply.keys, reply.tensors, strict=True)):
                key = mine.get(k)
                if key is None or list(t.shape) != [key.numel] or t.dtype != key.dtype:
                    raise PSError(
                        f"server {server} answered key {k} with {t.dtype} "
                        f"{list(t.shape)}; this worker's plan disagrees"
                    )
                scatter(key, t, targets)
                written.append(key)
                if reply.versions:
                    self.versions[k] = reply.versions[i]
        if self._staging is not None:
            self._staging.upload(written)  # to the GPU, queued on the caller's stream
        if server == 0 and "members" in reply.meta:  # elastic workers, sync (consistency.py)
            self.round = Round.of(reply.meta)


def _check_same(mine: list[ParamSpec], theirs: list[ParamSpec], rank: int) -> None:
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            raise PSError(
                f"worker {rank}'s parameter {i} is {a.name} {a.dtype} {list(a.shape)}; worker "
                f"0's is {b.name} {b.dtype} {list(b.shape)}: every worker must pass the same "
                "named_parameters"
            )
    if len(mine) != len(theirs):
        raise PSError(f"worker {rank} passed {len(mine)} parameters; worker 0 passed {len(theirs)}")
