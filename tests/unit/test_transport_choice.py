"""Which path CUDA tensors take, decided without a world: records name the device, every rank
agrees on the transport, no GPU means no NCCL, and `auto` on CUDA takes NCCL unless a CUDA
calibration says otherwise."""

from __future__ import annotations

import pytest
import torch

from plait import devices
from plait.comm.backends import cuda
from plait.comm.core.dtypes import dtype_from_name, on_device, record_name
from plait.comm.core.topology import Topology
from plait.comm.dispatch import auto, calibration
from plait.comm.dispatch.agreement import Call, agree
from plait.errors import CollectiveMismatchError


def test_records_name_the_device_so_cpu_and_gpu_ranks_disagree():
    meta = torch.empty(4, device="meta")
    assert record_name(torch.empty(4)) == "float32"
    assert record_name(meta) == "float32@meta"
    assert dtype_from_name("float32@cuda") is torch.float32
    assert on_device("float32") == torch.device("cpu")
    cpu = Call.of("allreduce", torch.empty(4), op="sum", algorithm="ring")
    gpu = Call("allreduce", "float32@cuda", (4,), op="sum", algorithm="ring")
    with pytest.raises(CollectiveMismatchError, match="float32@cuda"):
        agree([cpu, gpu])
    assert Call.decode(gpu.encode(2)) == gpu
    # a GPU record names its transport: ranks that would stage and ranks on NCCL disagree
    assert Call.of("allreduce", meta).dtype == "float32@meta:staged"  # no NCCL here
    nccl = Call("allreduce", "float32@cuda:nccl", (4,), op="sum", algorithm="ring")
    staged = Call("allreduce", "float32@cuda:staged", (4,), op="sum", algorithm="ring")
    with pytest.raises(CollectiveMismatchError, match="float32@cuda:staged"):
        agree([nccl, staged])
    assert dtype_from_name("float32@cuda:nccl") is torch.float32


def test_every_rank_agrees_on_the_transport(monkeypatch):
    """NCCL only if every rank can use it: one rank that cannot makes every rank stage
    (they would otherwise carry one call two ways and wait for each other forever)."""
    try:
        assert cuda.agree(["nccl", "nccl"]) == "nccl" and cuda.transport(None) == "nccl"
        assert cuda.agree(["nccl", "4 ranks share 1 GPU(s), which NCCL 2.21.5 refuses"]) == "staged"
        assert cuda.agree(["staged", "nccl"]) == "staged" and cuda.transport(None) == "staged"
        monkeypatch.setenv("PLAIT_CUDA_TRANSPORT", "nccl")
        with pytest.raises(devices.DeviceError, match="on rank 1: NCCL is not usable"):
            cuda.agree(["nccl", "NCCL is not usable here"])
    finally:
        cuda.forget()


def test_transport_without_a_gpu(monkeypatch):
    gpu = torch.device("cuda", 0)
    assert cuda.transport(gpu) == "staged"  # no NCCL here: staged through host memory
    monkeypatch.setenv("PLAIT_CUDA_TRANSPORT", "nccl")
    with pytest.raises(devices.DeviceError, match="NCCL is not usable here"):
        cuda.transport(gpu)
    monkeypatch.setenv("PLAIT_CUDA_TRANSPORT", "fast")
    with pytest.raises(ValueError, match="auto, nccl or staged; got 'fast'"):
        cuda.transport(gpu)


def test_auto_on_cuda_takes_nccl_unless_a_cuda_calibration_says_otherwise(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "calibration.json"))
    monkeypatch.setattr(cuda, "transport", lambda device: "nccl")
    topology = Topology(["a"] * 4, 0)
    gpu = torch.device("cuda", 0)
    assert auto.choose("allreduce", 1 << 20, topology, gpu) == "native"
    assert auto.choose("allreduce", 1 << 20, topology) == "shm"  # CPU tensors: unchanged
    # a calibration taken on CUDA in which the ring is twice as fast as NCCL at every size
    sizes = [1 << 10, 1 << 24]
    points = {
        a: [[n, n * 1e-9 * (2 if a == "native" else 1)] for n in sizes]
        for a in ("native", "ring", "halving_doubling", "tree")
    }
    calibration.save_calibration(4, 1, "allreduce", points, device="cuda")
    calibration.load_calibration(reload=True)
    assert auto.choose("allreduce", 1 << 20, topology, gpu) in (
        "ring",
        "halving_doubling",
        "tree",
    )
    assert auto.choose("allreduce", 1 << 20, topology) == "shm"  # the CPU key is untouched
    # staged CUDA tensors run the CPU rows, so they choose as CPU tensors do
    monkeypatch.setattr(cuda, "transport", lambda device: "staged")
    assert auto.choose("allreduce", 1 << 20, topology, gpu) == "shm"
