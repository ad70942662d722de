"""The parameter server's staging of CUDA tensors through pinned host memory, in one process
(marked `cuda`: skipped where no GPU is visible)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


def test_ps_staging_goes_through_pinned_host_memory() -> None:
    from plait.ps.sharding import ParamSpec, gather, make_plan, scatter
    from plait.ps.staging import Staging

    gpu = torch.device("cuda", 0)
    params = [torch.randn(5, 3, device=gpu), torch.randn(7, device=gpu), torch.randn(4)]
    staging = Staging(params)  # the last parameter stays on the CPU: used as it is
    host = staging.targets()
    assert host[0].is_pinned() and host[1].is_pinned()
    assert host[2].data_ptr() == params[2].data_ptr()
    assert torch.equal(host[0], params[0].cpu())  # the first copy, made at once

    grads = [torch.randn_like(p) for p in params]
    staged = staging.grads(grads, reuse=True)
    assert [g.device.type for g in staged] == ["cpu"] * 3 and staged[0].is_pinned()
    assert all(torch.equal(s, g.cpu()) for s, g in zip(staged, grads, strict=True))
    again = staging.grads(grads, reuse=False)  # the last push not answered: fresh buffers
    assert again[0].data_ptr() != staged[0].data_ptr()

    # a pull: the servers' values (keys of at most 8 floats, so parameters are cut and
    # packed) land in the host copies, then on the GPU
    specs = [ParamSpec(str(i), tuple(p.shape), p.dtype) for i, p in enumerate(params)]
    plan = make_plan(specs, 2, slice_bytes=32)
    served = [torch.randn(p.shape) for p in params]
    for key in plan.keys:
        scatter(key, gather(plan, key, served), staging.targets())
        staging.upload([key])
    torch.cuda.synchronize()
    assert all(torch.equal(p.cpu(), s) for p, s in zip(params, served, strict=True))
