"""What torch.distributed and CUDA give plait: process groups (gloo's, NCCL's), the paths of
CUDA tensors, and the links a Channel's messages take for them. No routing rows here: the
`native` rows that run these groups' collectives are algorithms/native.py.

    process_groups.py  a communicator's gloo group; the collective calls on a group
    cuda.py            NCCL groups and their abort, the transport every rank agrees on, the
                       stream hand-off of async calls, staging through pinned host memory
    device_links.py    GroupLink (batched point-to-point on a NCCL or gloo group),
                       StagedLink (host copies over the engine), LaneRequest
"""
