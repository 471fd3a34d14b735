"""A snapshot's device tensors staged into pinned host memory that is kept and reused.

DataStates-LLM (Maurya et al., HPDC'24, §4.2) copies device state into host memory allocated and
page-locked once, so a capture runs at the link's device-to-host speed. Allocating page-locked
memory costs far more than copying into it (``cudaHostAlloc`` maps and locks every page: on the H200
of ``make gpu-check`` a capture that allocated per tensor ran at 0.8 % of a copy into memory pinned
beforehand), so :class:`PinnedStage` keeps one buffer, grown to the largest file it staged, and
copies every tensor of a file into it on a side stream with one synchronization at the end.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

# each tensor's copy starts on a block of O_DIRECT (4096 bytes) of the buffer, which pinned memory
# (page aligned) makes a page: the snapshot writer then writes it from there, without a copy into
# its host cache (io_engine.writer); the padding costs at most 4 KiB per tensor
ALIGN_BYTES = 4096


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class PinnedStage:
    """One page-locked host buffer (uint8) holding the byte copies of one file's tensors.

    ``pin``: allocate page-locked memory (default: where CUDA is available; plain host memory
    otherwise, which is how the staging is tested on a CPU).

    Used by one thread at a time (the snapshot engine's worker): the copies of one :meth:`stage`
    call are valid until the next call or :meth:`release`. The buffer grows to the largest set of
    tensors staged (bytes, each tensor rounded up to :data:`ALIGN_BYTES`) and is kept.
    """

    def __init__(self, pin: Optional[bool] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin  # page-locked where CUDA runs
        self._buf: Optional[torch.Tensor] = None
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of pinned host memory held now."""
        return 0 if self._buf is None else self._buf.numel()

    def _stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def stage(self, tensors: Sequence[torch.Tensor], ready=None) -> List[torch.Tensor]:
        """Byte copies of ``tensors`` (each flattened: uint8, ``numel * element_size`` bytes) in the
        pinned buffer, complete when this returns. A CUDA tensor is copied on a side stream of its
        device that first waits for ``ready`` (a ``torch.cuda.Event`` recorded on the training
        stream when the state was handed over, or None), so the copy sees the state of that moment
        and overlaps compute; a CPU tensor is copied directly.

        Raises:
            RuntimeError: page-locked memory cannot be allocated (torch's error; nothing is kept).
        """
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total = _aligned(total + t.numel() * t.element_size())
        if self._buf is None or self._buf.numel() < total:
            self._buf = None  # free the smaller buffer before the larger one is allocated
            self._buf = torch.empty(total, dtype=torch.uint8, pin_memory=self.pin)
        out, waiting = [], {}
        for t, off in zip(tensors, offsets):
            src = t.detach().reshape(-1).view(torch.uint8)
            dst = self._buf[off : off + src.numel()]
            if t.device.type == "cuda":
                stream = self._stream(t.device)
                if t.device not in waiting:
                    if ready is not None:
                        stream.wait_event(ready)
                    waiting[t.device] = stream
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out.append(dst)
        for stream in waiting.values():
            stream.synchronize()
        return out

    def release(self) -> None:
        """Free the pinned buffer (the next :meth:`stage` allocates again)."""
        self._buf = None
