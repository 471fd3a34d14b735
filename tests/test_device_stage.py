"""The pinned staging of a snapshot's device tensors (``checkpoint/device_stage.py``), on host memory.

Page-locked memory needs CUDA; ``PinnedStage(pin=False)`` runs the same offsets, copies, reuse and
growth on plain host memory (``make gpu-check`` runs the pinned path on a GPU)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.checkpoint.device_stage import ALIGN_BYTES, PinnedStage

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def _tensors(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        dtype = DTYPES[i % len(DTYPES)]
        t = torch.randint(0, 255, shape, generator=g).to(dtype)
        out.append(t if t.dim() < 2 else t.transpose(0, 1))  # a non-contiguous tensor among them
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=6),
    st.integers(0, 2**16),
)
def test_staged_copies_hold_each_tensors_bytes_and_outlive_a_change_of_the_state(shapes, seed):
    tensors = _tensors([tuple(s) for s in shapes], seed)
    stage = PinnedStage(pin=False)
    copies = stage.stage(tensors)
    want = [t.contiguous().reshape(-1).view(torch.uint8).clone() for t in tensors]
    for t in tensors:  # the live state changes after the capture
        t.zero_() if t.dtype != torch.bool else t.fill_(True)
    assert len(copies) == len(tensors)
    for c, w in zip(copies, want):
        assert c.dtype == torch.uint8 and torch.equal(c, w)
    # each copy starts on an aligned offset of one buffer, and none overlap
    base = stage._buf.data_ptr()
    spans = sorted((c.data_ptr() - base, c.numel()) for c in copies if c.numel())
    assert all(off % ALIGN_BYTES == 0 for off, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_the_buffer_is_kept_for_smaller_sets_grows_for_larger_and_is_released():
    stage = PinnedStage(pin=False)
    big = [torch.arange(1000, dtype=torch.float32), torch.ones(10, dtype=torch.bfloat16)]
    stage.stage(big)
    held, ptr = stage.nbytes, stage._buf.data_ptr()
    assert held == 8192  # the first takes 4000 bytes, the second starts at the next block (4096) and ends at 4116
    small = stage.stage([torch.full((7,), 3.0)])
    assert stage.nbytes == held and stage._buf.data_ptr() == ptr  # reused, not reallocated
    assert torch.equal(small[0].view(torch.float32), torch.full((7,), 3.0))
    stage.stage([torch.zeros(5000, dtype=torch.float32)])
    assert stage.nbytes == 20480  # grown to the larger set (20000 bytes, to a whole block)
    stage.release()
    assert stage.nbytes == 0
