"""comm's vocabulary, below every other layer of comm/: the words each layer above uses.

request.py    Request (what every async call returns), Transfer, Future
channel.py    Channel (what algorithms are written against), Link (what a channel's
              messages go through), sendrecv, wait_all
topology.py   Topology: hosts, node and local ranks, the two levels across hosts
ops.py        reduction operators: the names users pass, the in-place kernels
dtypes.py     the one table of the dtypes carried between ranks (names and codes)
"""
