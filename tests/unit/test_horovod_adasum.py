"""hvd.Adasum (plait/horovod/torch/adasum.py, adasum_optimizer.py) in one process, against
references written from the paper's formula (Maleki et al., MLSys 2021;
tests/support/adasum_reference.py):

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

per tensor, a squared norm under 1e-8 counting as zero (coefficient 1, Horovod's rule): the
pair on known vectors, the dot products in float64, a fused buffer, the tree and its
refusals. Across ranks: tests/world/test_horovod_adasum_ranks.py.
"""

from __future__ import annotations

import pytest
import torch

from plait.horovod.torch import adasum
from support.adasum_reference import data, ref_pair, ref_tree

# --------------------------------------------------------------- the references


# ------------------------------------------------------------------ one process
def test_pair_on_known_vectors() -> None:
    e1, e2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    v, zero = torch.tensor([3.0, -1.0, 2.0]), torch.zeros(3)
    assert torch.equal(adasum.pair(e1, e2), e1 + e2)  # orthogonal: the sum
    assert torch.equal(adasum.pair(v, v), v)  # identical: the vector, not twice it
    assert torch.equal(adasum.pair(v, -v), zero)  # opposite: coefficients 3/2, cancel
    assert torch.equal(adasum.pair(zero, v), v)  # a zero vector gives the other one
    assert torch.equal(adasum.pair(v, zero), v)
    assert torch.equal(adasum.pair(zero, zero), zero)
    tiny = torch.full((3,), 1e-5)  # |tiny|^2 = 3e-10 < 1e-8: counts as zero (coefficient 1)
    assert torch.allclose(adasum.pair(tiny, v), tiny + (1 - (tiny @ v) / (2 * 14)) * v)
    # neither orthogonal nor parallel: the reference's numbers
    for a, b in [(2 * v, v), (e1 + e2, e2), (torch.tensor([1.0, 1.0, 0.0]), e1)]:
        assert torch.allclose(adasum.pair(a, b), ref_pair(a, b), rtol=0, atol=1e-6)
    assert torch.equal(adasum.pair(2 * v, v), 1.5 * v)  # (1 - 1/4) 2v + (1 - 1) v


def test_dot_products_accumulate_in_float64() -> None:
    # float16 inputs whose squared norm overflows float16 (65504): coefficients stay exact
    a = torch.full((4,), 200.0, dtype=torch.float16)
    assert torch.equal(adasum.pair(a, a), a)
    b = torch.tensor([200.0, 0.0, 0.0, 0.0], dtype=torch.float16)
    assert torch.equal(adasum.pair(a, b), ref_pair(a, b))


def test_fused_buffer_treats_each_tensor_alone() -> None:
    x = data(0, 1, [(3,), (2, 2), (1,)])
    y = data(1, 1, [(3,), (2, 2), (1,)])
    flat_x, flat_y = torch.cat([t.reshape(-1) for t in x]), torch.cat([t.reshape(-1) for t in y])
    got = adasum.pair(flat_x, flat_y, sizes=[3, 4, 1])
    want = torch.cat([ref_pair(a, b).reshape(-1) for a, b in zip(x, y, strict=True)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    whole = adasum.pair(flat_x, flat_y)  # one tensor: other coefficients
    assert not torch.allclose(whole, got)
    # an empty tensor among them is fine (no elements, no coefficients)
    got0 = adasum.pair(flat_x, flat_y, sizes=[3, 0, 4, 1])
    torch.testing.assert_close(got0, got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="add up to the buffer's 8 elements; got"):
        adasum.pair(flat_x, flat_y, sizes=[3, 4])


def test_tree_and_refusals() -> None:
    vs = data(0, 2, [(5,)] * 4)
    torch.testing.assert_close(adasum.tree(vs), ref_tree(vs), rtol=0, atol=1e-6)
    assert torch.equal(adasum.tree(vs[:1]), vs[0])
    with pytest.raises(TypeError, match=r"float16, float32 and float64.*got torch.int32"):
        adasum.tree([torch.ones(2, dtype=torch.int32)] * 2)
    with pytest.raises(TypeError, match=r"got torch.bfloat16"):
        adasum.check_dtype(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"power-of-2 .* this process set has 3"):
        adasum.tree(vs[:3])
    with pytest.raises(ValueError, match="power-of-2"):  # also a ValueError
        adasum.check_size(6)
    for ok in (1, 2, 4, 8, 64):
        adasum.check_size(ok)


# ------------------------------------------------------- a tiny model to train


# ------------------------------------------------------------ worlds of 2 and 4


# ------------------------------------------------------------------ 3 ranks
