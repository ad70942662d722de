"""Rank 1 raises between two allreduces; the others are left waiting on it."""

import torch

import plait

comm = plait.init()
comm.allreduce(torch.ones(3))
if comm.rank == 1:
    raise RuntimeError("boom on rank 1")
comm.allreduce(torch.ones(3))
