"""`plait bench torch-backend`: torch's DDP, FSDP2 and a small all_reduce on the
torch.distributed backend "plait" against "gloo" (or "nccl"), the same code on each.

config.py the options and the bars; job.py the parent side; ranks.py a worker rank;
tables.py the report.
"""
