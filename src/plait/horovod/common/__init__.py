"""Horovod's `horovod.common` module paths: `plait.horovod.common.exceptions` holds
HorovodInternalError and HostsUpdatedInterrupt, as `horovod.common.exceptions` does."""
