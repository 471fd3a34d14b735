"""The memory a prepared switch touches ahead (``engine/switch_memory.py``): a TP/PP switch and a
DP job's change of world size. The estimate against the layouts' own sizes (worked by hand from
DeepSpeed's padding rules), the look-ahead at the schedule and at a request being prepared, and
the background hold (a real thread, real memory, measured by the process's resident set)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
from test_pp_plan import _tied_model

from ds_dynatrain.config import DynatrainConfig
from ds_dynatrain.engine.switch_memory import (
    CHUNK_BYTES,
    WORKING_COPIES,
    HeldMemory,
    band_numel,
    next_band_switch,
    next_world_change,
    partition_numel,
    release_switch_memory,
    switch_bytes,
    world_change_bytes,
    world_change_partitions,
)
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout
from ds_dynatrain.vps.pipeline import PipelineLayout


def test_pp2_to_pp1_holds_the_new_partitions_and_the_growth_of_the_working_parameters():
    layers = _tied_model()  # a tied embedding (16 x 4), four blocks of 4 x 4 + 4, a norm of 4
    old = PipelineLayout(2, 1, layers, (0, 3, 7))  # stage 0: embed + blocks 1, 2; stage 1: blocks 3, 4, norm, embed
    new = PipelineLayout(1, 2, layers, (0, 7))  # every parameter on both ranks, ZeRO-1 over DP 2
    assert (band_numel(old, 0), band_numel(old, 1), band_numel(new, 0)) == (104, 108, 148)
    assert partition_numel(new, 0) == partition_numel(new, 1) == 74  # half of 148 each
    # 74 x 4 bytes x 3 kinds (fp32 master, two moments) + 3 copies x (148 - 104 | 108) x 2 bytes (bf16)
    assert switch_bytes(old, new, 0, working_size=2, state_kinds=3) == 888 + 3 * 44 * 2 == 1152
    assert switch_bytes(old, new, 1, working_size=2, state_kinds=3) == 888 + 3 * 40 * 2 == 1128
    # the way back shrinks every rank's working parameters: only the new partitions (a stage each)
    assert switch_bytes(new, old, 0, 4, 3) == 104 * 4 * 3 and switch_bytes(new, old, 1, 4, 3) == 108 * 4 * 3
    assert WORKING_COPIES == 3


def test_a_change_of_world_size_holds_the_new_partitions():
    groups = (
        (ParamMeta("fc.weight", (10, 10), "float32"), ParamMeta("fc.bias", (10,), "float32")),
        (ParamMeta("ln.weight", (7,), "float32"),),
    )
    one = ZeroLayout(1, groups, stage=2)
    # ZeRO-1/2: each group padded to a multiple of 2 x world size, cut in equal partitions;
    # 3 fp32 kinds (master, two moments), 4 bytes each
    assert world_change_bytes(one, 1, 3) == (110 + 8) * 12  # 110 | 7 -> 8
    assert world_change_bytes(one, 2, 3) == (112 // 2 + 8 // 2) * 12 == 720  # 110 -> 112 | 7 -> 8
    assert world_change_bytes(one, 3, 3) == (114 // 3 + 12 // 3) * 12 == 504  # 110 -> 114 | 7 -> 12
    assert world_change_bytes(one, 2, 1) == 240  # the master only (a momentless optimizer)
    # the tensors held: each partition's length once per kind, in partition order
    assert world_change_partitions(one, 3, 3) == [38, 38, 38, 4, 4, 4]
    # ZeRO-3: each parameter cut in world-size pieces (rounded up), one sub-group per group here
    three = ZeroLayout(1, groups, stage=3)
    assert world_change_bytes(three, 2, 3) == (50 + 5 + 4) * 12 == 708


def _dt(schedule, pp=2, members=2, ahead=2, tp=None, dp=False, preparing=None):
    cfg = DynatrainConfig(resize_schedule=schedule, warm_switch_steps=ahead)
    return SimpleNamespace(
        config=cfg,
        preparing=preparing,
        tp_layout=None if tp is None else SimpleNamespace(tp=tp),
        pp_layout=SimpleNamespace(pp=pp) if tp is None and not dp else None,
        tp=tp or 1,
        members=("a",) * members,
        schedule={e.step: e.world_size for e in cfg.resize_schedule},
        pp_schedule={e.step: e.pipeline_parallel for e in cfg.resize_schedule if e.pipeline_parallel is not None},
        tp_schedule={e.step: e.tensor_parallel for e in cfg.resize_schedule if e.tensor_parallel is not None},
    )


@pytest.mark.parametrize(
    "step,schedule,ahead,want",
    [
        (3, [{"step": 5, "world_size": 2, "pipeline_parallel": 1}], 2, (2, 1)),  # two steps ahead
        (2, [{"step": 5, "world_size": 2, "pipeline_parallel": 1}], 2, None),  # three: not yet
        (5, [{"step": 5, "world_size": 2, "pipeline_parallel": 1}], 2, None),  # its own step: done
        (4, [{"step": 5, "world_size": 2, "pipeline_parallel": 2}], 2, None),  # the degree it has
        (4, [{"step": 5, "world_size": 4, "pipeline_parallel": 1}], 2, None),  # a grow: its joiners' warm-up
        (4, [{"step": 5, "world_size": 2, "pipeline_parallel": 1}], 0, None),  # off
        (  # the next entry decides, not a later one
            4,
            [
                {"step": 5, "world_size": 4, "pipeline_parallel": 2},
                {"step": 6, "world_size": 2, "pipeline_parallel": 1},
            ],
            2,
            None,
        ),
    ],
)
def test_next_band_switch_looks_ahead_at_the_schedule(step, schedule, ahead, want):
    assert next_band_switch(_dt(schedule, ahead=ahead), step) == want


def test_next_band_switch_of_an_autotp_job():
    schedule = [{"step": 4, "world_size": 2, "tensor_parallel": 1}, {"step": 6, "world_size": 2, "tensor_parallel": 2}]
    assert next_band_switch(_dt(schedule, tp=2), 2) == (2, 1)
    assert next_band_switch(_dt(schedule, tp=2), 4) is None  # TP 2 is the job's degree
    assert next_band_switch(_dt(schedule, tp=1), 4) == (2, 2)
    assert next_band_switch(_dt([{"step": 4, "world_size": 2}], tp=2), 3) is None  # no TP degree given


@pytest.mark.parametrize(
    "step,schedule,ahead,want",
    [
        (1, [{"step": 3, "world_size": 4}], 2, 4),  # a grow two steps ahead
        (2, [{"step": 3, "world_size": 1}], 2, 1),  # a shrink one step ahead
        (0, [{"step": 3, "world_size": 4}], 2, None),  # three: not yet
        (3, [{"step": 3, "world_size": 4}], 2, None),  # its own step: done
        (2, [{"step": 3, "world_size": 2}], 2, None),  # the size it has
        (2, [{"step": 3, "world_size": 4}], 0, None),  # off
        (2, [{"step": 3, "world_size": 2}, {"step": 4, "world_size": 4}], 2, None),  # the next entry decides
    ],
)
def test_next_world_change_of_a_dp_job(step, schedule, ahead, want):
    assert next_world_change(_dt(schedule, ahead=ahead, dp=True), step) == want


def test_next_world_change_of_a_request_prepared_behind_training():
    grow = SimpleNamespace(world_size=3)
    assert next_world_change(_dt([], dp=True, preparing=grow), 5) == 3  # held until the switch
    assert next_world_change(_dt([{"step": 6, "world_size": 1}], dp=True, preparing=grow), 5) == 3
    assert next_world_change(_dt([], dp=True, preparing=grow, ahead=0), 5) is None
    assert next_world_change(_dt([], dp=True, preparing=SimpleNamespace(world_size=2)), 5) is None
    # band jobs: their grows are prepared by the joiners, their switches by next_band_switch
    assert next_world_change(_dt([{"step": 6, "world_size": 4}], tp=2), 5) is None
    assert next_world_change(_dt([{"step": 6, "world_size": 4}], pp=2), 5) is None


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_held_memory_is_touched_in_the_background_and_freed_at_release():
    nbytes = 96 << 20  # two pieces
    base = _rss()
    hold = HeldMemory(nbytes, ("pp", 2, 1))
    deadline = time.monotonic() + 30
    while hold.touched < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hold.touched == nbytes
    assert _rss() - base >= 0.9 * nbytes  # resident: every page written
    dt = SimpleNamespace(switch_hold=hold)
    rec = SimpleNamespace(prepared_bytes=None, prepared_touch_s=None)
    release_switch_memory(dt, rec)
    assert dt.switch_hold is None and rec.prepared_bytes == nbytes and rec.prepared_touch_s > 0
    assert _rss() - base < 0.5 * nbytes  # given back
    release_switch_memory(dt, rec)  # nothing held: nothing happens
    assert rec.prepared_bytes == nbytes
    # a hold made for another layout is freed all the same, but not counted as this switch's
    dt.switch_hold = HeldMemory(CHUNK_BYTES, ("dp", 3, None))
    other = SimpleNamespace(prepared_bytes=None, prepared_touch_s=None)
    release_switch_memory(dt, other, key=("dp", 4, None))
    assert dt.switch_hold is None and other.prepared_bytes is None


def test_a_world_change_hold_hands_its_partitions_over_written():
    """A DP resize's hold: its partition tensors (fp32, the new partitions' lengths) are written
    first and handed to the resize whose key is the hold's, the rest is freed; a release for
    another world size frees them too and hands nothing over (real thread, real memory)."""
    numels = [(40 << 20) // 4, (40 << 20) // 4, 1000]  # two 40 MiB partitions, a small one
    nbytes = 4 * sum(numels) + CHUNK_BYTES
    base = _rss()
    hold = HeldMemory(nbytes, ("dp", 3, None), numels)
    deadline = time.monotonic() + 30
    while hold.touched < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hold.touched == nbytes and _rss() - base >= 0.9 * nbytes
    dt = SimpleNamespace(switch_hold=hold)
    rec = SimpleNamespace(prepared_bytes=None, prepared_touch_s=None)
    tensors = release_switch_memory(dt, rec, key=("dp", 3, None))
    assert [t.numel() for t in tensors] == numels and all(t.dtype == torch.float32 for t in tensors)
    assert all(int(t.count_nonzero()) == 0 for t in tensors)  # written: zeros
    assert rec.prepared_bytes == nbytes and dt.switch_hold is None
    assert _rss() - base < 4 * sum(numels) + CHUNK_BYTES // 2  # the uint8 piece given back
    del tensors
    dt.switch_hold = HeldMemory(4 * sum(numels), ("dp", 3, None), numels)
    assert release_switch_memory(dt, rec, key=("dp", 4, None)) == []


def test_a_release_stops_the_thread_after_the_piece_it_writes():
    nbytes = 512 << 20
    hold = HeldMemory(nbytes, ("tp", 2, 1))
    deadline = time.monotonic() + 30
    while hold.touched < CHUNK_BYTES and time.monotonic() < deadline:
        time.sleep(0.001)
    touched, seconds, tensors = hold.release()
    assert CHUNK_BYTES <= touched <= nbytes and touched % CHUNK_BYTES == 0 and seconds > 0
    assert not hold._thread.is_alive() and hold._chunks == [] and tensors == []
