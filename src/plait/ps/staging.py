"""Host copies of a worker's GPU parameters and gradients: what the wire reads and writes.

The servers hold and update the parameters in host memory, and the wire sends host bytes;
a worker whose model is on a GPU goes through page-locked (pinned) host buffers, so that
its copies are DMA transfers queued on the worker's CUDA stream:

    push   gradient (GPU) --non_blocking--> pinned buffer; one event; the host waits for
           it, then the transport sends from the buffer (the servers read the copy)
    pull   reply frame --> pinned copy of the parameter (host), then --non_blocking--> the
           parameter (GPU), queued before whatever the stream runs next (the forward);
           an event marks when the GPU has read the copies, and the next pull waits for it
           before writing them again

Parameters already on the CPU are used as they are (`Client` then behaves exactly as
without a GPU). Pinned memory needs a CUDA build with a GPU, which a parameter on a GPU
implies; `Client` makes a `Staging` only then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.ps.errors import PSError
from plait.ps.sharding import Key


class Staging:
    """Pinned host copies of the CUDA tensors among `params` (one CUDA device)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        gpus = sorted({str(p.device) for p in self.params if p.device.type == "cuda"})
        if len(gpus) != 1:
            raise PSError(f"a ps.Client stages one GPU's parameters; these are on {gpus}")
        self.device = torch.device(gpus[0])
        self.on_gpu = [p.device.type == "cuda" for p in self.params]
        # the values as the servers last sent them (or, first, as the model holds them)
        self.values = self._buffers()
        self._grads = self._buffers()
        with torch.no_grad():
            for host, p, on in zip(self.values, self.params, self.on_gpu, strict=True):
                if on:
                    host.copy_(p.detach(), non_blocking=True)
        self._event().synchronize()
        self._read: torch.cuda.Event | None = None  # the last pull's copies to the GPU

    def _buffers(self) -> list[torch.Tensor]:
        """A pinned host tensor per CUDA parameter; a CPU parameter is its own."""
        return [
            torch.empty(p.shape, dtype=p.dtype, pin_memory=True) if on else p
            for p, on in zip(self.params, self.on_gpu, strict=True)
        ]

    def _event(self) -> torch.cuda.Event:
        """An event recorded now on the current stream of the parameters' GPU."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def grads(self, grads: Sequence[torch.Tensor], reuse: bool) -> list[torch.Tensor]:
        """Host copies of `grads`, complete when this returns (CPU gradients as they are).

        reuse: whether the pinned buffers are free, i.e. the last push that sent from them
            has been answered; if not, this push gets new ones.
        """
        if not reuse:
            self._grads = self._buffers()
        out = []
        for g, buf, on in zip(grads, self._grads, self.on_gpu, strict=True):
            if on and g.device.type == "cuda":
                out.append(buf.copy_(g.detach(), non_blocking=True))
            else:
                out.append(g.detach().cpu())  # a CPU gradient as it is
        self._event().synchronize()  # the DMA has landed: the transport may read the buffers
        return out

    def targets(self) -> list[torch.Tensor]:
        """Where a pull writes: the pinned copies (and CPU parameters), once the GPU has read
        the previous pull's copies out of them."""
        if self._read is not None:
            self._read.synchronize()
            self._read = None
        return self.values

    def upload(self, keys: Sequence[Key]) -> None:
        """Queue the copies of `keys`' segments from their pinned copies to the GPU."""
        with torch.no_grad():
            for key in keys:
                for s in key.segments:
                    if self.on_gpu[s.param]:
                        host = self.values[s.param].view(-1)[s.start : s.stop]
                        gpu = self.params[s.param].detach().view(-1)[s.start : s.stop]
                        gpu.copy_(host, non_blocking=True)
        self._read = self._event()
