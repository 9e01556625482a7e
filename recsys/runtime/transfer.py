"""Copies between host memory and a compute device that overlap the device's work.

On a GPU every copy runs on a side stream of its own, from or to pinned host memory, with
``non_blocking=True``; an event marks its end. The consumer makes its own stream wait for
that event (``arrive``) instead of blocking its thread, so the copy of step t+1's inputs
runs while the GPU still works on step t::

    host thread:  fill pinned buffer ─► to_device(...) ─► (returns at once)
    side stream:                        H2D copy ────────► event
    compute stream:   ... step t kernels ...  wait(event) ─► step t+1 kernels

On the CPU (and on devices without streams) nothing is copied or awaited: ``to_device``
returns the tensors moved synchronously (the same tensors on the CPU) and no event.

The caching allocators make the reuse safe: pinned blocks from ``torch.empty(...,
pin_memory=True)`` are not handed out again before the copies that read them end, and
``arrive`` marks device tensors made on the side stream as used by the consumer's stream
(``Tensor.record_stream``), so their memory is not reused while that stream reads them.
"""

from __future__ import annotations

import torch

__all__ = ["Transfers", "arrive"]


class Transfers:
    """Host ↔ ``device`` copies on a side stream (see module doc). One per thread that copies."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def to_device(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
        """Return ``tensors`` (host) on the device and the event after which they are there
        (None: they are there now). Host tensors not pinned are copied into pinned memory first."""
        if self.stream is None:
            return [t.to(self.device) for t in tensors], None
        with torch.cuda.stream(self.stream):
            out = [(t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
        """Return host copies of device ``tensors`` and the event after which they hold the
        values (None: they do now). The copies start after the work the calling thread's
        stream has queued so far (e.g. the backward that made the gradients)."""
        if self.stream is None:
            return [t.to("cpu") for t in tensors], None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # its memory stays until the copy has read it
                out.append(host)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event


def arrive(tensors: list[torch.Tensor | None], event: "torch.cuda.Event | None") -> None:
    """Make the calling thread's stream wait for ``event`` (from ``to_device``) before its
    next kernels, and mark the device ``tensors`` as used by that stream. No-op without event."""
    if event is None:
        return
    tensors = [t for t in tensors if t is not None]
    stream = torch.cuda.current_stream(tensors[0].device if tensors else None)
    stream.wait_event(event)
    for t in tensors:
        t.record_stream(stream)
