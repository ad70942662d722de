"""What moving bytes costs: the calibrated alpha-beta model per level (plait.comm's: each
algorithm's formula in its module, dispatch/calibration.py's measurements).

Two levels, as the hierarchical allreduce has them: *local*, between the ranks of one host
(shared memory; its collectives' cost is `plait bench collectives --calibrate`'s
measurements at that world size when there are any, else the alpha-beta formulas with
`DEFAULT`, this machine's constants), and *network*, between hosts (`NETWORK`:
100 us a message, and `--link-rate` for its bandwidth, 1 Gbit/s by default). A collective
whose ranks span hosts is costed as plait's two-level allreduce (`hierarchical.allreduce_cost`).
Point-to-point sends inside a host cost a shared-memory synchronisation plus the bytes at
`SHM_BETA`; across hosts, the network's alpha + n beta.

On GPUs (`plait plan --device cuda`) the local level is NCCL between the host's GPUs: the
calibration's measurements of CUDA tensors at that world size where `plait bench
collectives --calibrate` took them on a GPU machine, else `NCCL`, a default that is NOT
calibrated (order-of-magnitude figures, see its comment). A send is alpha + n beta on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.comm.algorithms import hierarchical, shm, tree
from plait.comm.algorithms.model import DEFAULT, NETWORK, AlphaBeta
from plait.comm.dispatch import auto, calibration

#: NCCL between one host's GPUs where nothing was calibrated on CUDA tensors. NOT measured:
#: ~20 us to launch and synchronise a collective or send, and 50 GB/s per link, between
#: PCIe 4.0 x16 (~25 GB/s) and NVLink (hundreds of GB/s); elementwise work at 500 GB/s
#: (HBM). Calibrate (`plait bench collectives --calibrate --device cuda`) to replace it.
NCCL = AlphaBeta(alpha=20e-6, beta=1 / 50e9, gamma=1 / 500e9, native_alpha=20e-6,
                 native_beta=1 / 50e9)  # fmt: skip


def _local_allreduce(n: int, p: int, device: str = "cpu") -> float:
    """Seconds of the best flat allreduce of n bytes over p ranks of one host (their tensors
    on `device`)."""
    key = calibration.world_key(p, 1, device)
    measured = calibration.load_calibration().get(key, {}).get("allreduce", {})
    times = [calibration.interpolate(points, n) for points in measured.values() if points]
    if times:
        return min(times)
    link = NCCL if device == "cuda" else DEFAULT
    return min(auto.predict(a, n, p, link) for a in auto.FLAT["allreduce"])


@dataclass(frozen=True)
class Costs:
    """Communication costs for ranks laid `local` to a host (rank r on host r // local)."""

    local: int  # ranks per host
    network: AlphaBeta = NETWORK
    device: str = "cpu"  # where the ranks' tensors are: cpu (shared memory) or cuda (NCCL)

    @classmethod
    def of(cls, local: int, link_bytes_per_s: float | None, device: str = "cpu") -> Costs:
        net = NETWORK
        if link_bytes_per_s is not None:
            beta = 1 / link_bytes_per_s
            net = replace(NETWORK, beta=beta, native_beta=beta)
        return cls(local, net, device)

    @property
    def inside(self) -> AlphaBeta:
        """The alpha-beta constants between two ranks of one host."""
        return NCCL if self.device == "cuda" else DEFAULT

    def host(self, rank: int) -> int:
        return rank // self.local

    def level(self, ranks: list[int]) -> str:
        """ "local" when every rank is on one host, else "network"."""
        return "local" if len({self.host(r) for r in ranks}) == 1 else "network"

    def allreduce(self, n: float, ranks: list[int]) -> float:
        """Seconds of an allreduce of n bytes over `ranks`."""
        p = len(ranks)
        if p <= 1 or n <= 0:
            return 0.0
        hosts = len({self.host(r) for r in ranks})
        if hosts == 1:
            return _local_allreduce(int(n), p, self.device)
        return hierarchical.allreduce_cost(int(n), hosts, p // hosts, self.network)

    def allgather(self, n: float, ranks: list[int]) -> float:
        """Seconds of a ring all-gather where every rank contributes n bytes."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        link = self.link(ranks)
        return (p - 1) * (link.alpha + n * link.beta)

    def link(self, ranks: list[int]) -> AlphaBeta:
        """The alpha-beta constants of a collective over `ranks`: the host's inside one,
        the network's across (every message priced at the slower level)."""
        return self.inside if self.level(ranks) == "local" else self.network

    def reduce_scatter(self, n: float, ranks: list[int]) -> float:
        """Seconds of a ring reduce-scatter of n bytes on every rank (each keeps n / p,
        summed): (p-1) messages of n/p bytes, each reduced (Thakur et al. 2005)."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        c = self.link(ranks)
        return (p - 1) * (c.alpha + n / p * (c.beta + c.gamma))

    def alltoall(self, n: float, ranks: list[int]) -> float:
        """Seconds of a pairwise all-to-all of a tensor of n bytes in all, n / p on each
        rank: p-1 rounds, each sending one rank n / p^2 bytes."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        c = self.link(ranks)
        return (p - 1) * (c.alpha + n / (p * p) * c.beta)

    def gather(self, n: float, ranks: list[int], root: int | None = None) -> float:
        """Seconds of gathering a tensor of n bytes in all (n / p on each rank) on `root`
        (the first of `ranks` by default): it receives p-1 messages, (p-1)/p n bytes, one
        after another, each at the level between the sender and it (no ring: a message
        from the root's own host never crosses the network); scatter is its mirror."""
        p = len(ranks)
        root = ranks[0] if root is None else root
        links = [self.link([root, r]) for r in ranks if r != root]
        return sum(c.alpha + n / p * c.beta for c in links)

    scatter = gather

    def broadcast(self, n: float, ranks: list[int]) -> float:
        """Seconds of a binomial-tree broadcast of n bytes (lg p messages of n bytes each);
        reduce is its mirror, its additions left out as comm's formula leaves them."""
        p = len(ranks)
        return tree.one_way_cost(int(n), p, self.link(ranks)) if p > 1 else 0.0

    reduce = broadcast

    def to_servers(self, n: float, workers: int, servers: int) -> float:
        """Seconds for `workers` ranks to each push n bytes to `servers` servers (each takes
        its 1/servers slice from every worker over its own link), or to pull them back."""
        link = DEFAULT if self.local * 1 >= workers else self.network
        return link.alpha + workers * n / servers * link.beta

    def send(self, n: float, src: int, dst: int) -> float:
        """Seconds of a point-to-point send of n bytes."""
        if self.host(src) == self.host(dst) and self.device == "cuda":
            return self.inside.alpha + n * self.inside.beta
        if self.host(src) == self.host(dst):
            return shm.SHM_SYNC + n * shm.SHM_BETA
        return self.network.alpha + n * self.network.beta
