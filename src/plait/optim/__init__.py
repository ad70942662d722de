"""Optimizers the large-batch literature needs and torch.optim lacks: `LARS` (You et al.
2017) and `LAMB` (You et al. 2020), each scaling a layer's update by a trust ratio of two
norms of that layer.

    optimizer = plait.LAMB(model.parameters(), lr=2e-3)              # whole parameters
    sdp = plait.ShardedDataParallel(model, stage=3)                     # or ZeRO's shards:
    optimizer = plait.LAMB(sdp.parameters(), lr=2e-3, layers=plait.sharded.layer_map(sdp))

Under `plait.DataParallel` every rank holds the same averaged gradient, so nothing more is
needed. Under ZeRO the norms are those of each whole parameter, summed over the ranks'
shards by one allreduce per step (layers.py).
"""

from plait.optim.lamb import LAMB
from plait.optim.lars import LARS
from plait.optim.layers import LayerMap, Segment

__all__ = ["LAMB", "LARS", "LayerMap", "Segment"]
