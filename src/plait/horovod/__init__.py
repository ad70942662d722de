"""Horovod's API on plait: `import plait.horovod.torch as hvd` in place of `import horovod.torch`.

See `plait.horovod.torch` for what is covered and where it differs from Horovod 0.28.
"""
