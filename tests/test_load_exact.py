"""``ElasticEngine.load_checkpoint`` gives the client state back exactly, and refuses a checkpoint of
another model at any world size with one ``LayoutMismatchError`` per rank, the engine unchanged.

Multi-process (real DeepSpeed engines, gloo, no launcher; ``tests/workers/load_exact_worker.py``):
a 2-rank job saves TinyLM (ZeRO-2 and ZeRO-3) with a client state of tensors of many dtypes and sizes (1 MiB
of float32, bf16, fp16, int64, bool, 0-d, empty, non-contiguous, nested in dicts, lists and
tuples) in both formats (this project's snapshots, DeepSpeed's ``torch.save`` files), and
checkpoints of four other models (a wider embedding, an extra parameter, a parameter fewer, the
same parameters registered in another order).
Load jobs at 1, 2 and 4 ranks (1 and 4: the resharded load; 2: DeepSpeed's own) load them; the
other models' checkpoints are ZeRO-2.

Oracles: the client state each rank gets back equals, bitwise, dtype and shape included,
:func:`load_exact_worker.client_state` (the function that made it, called here); every rank's
error for another model is ``LayoutMismatchError``, naming the parameter once; an engine that
tried those loads trains its next step to the losses and state, bitwise, of an engine that never
did.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import WORKERS, read_jsonl, run_plain

# client state through resharded loads at three sizes (make test-slow)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(WORKERS, "load_exact_worker.py")
LOAD_SIZES = (1, 2, 4)  # 2 -> 1 and 2 -> 4: the resharded load; 2 -> 2: DeepSpeed's own
# the first difference each check meets, with the live model TinyLM (width 13) as the reference
EXPECTED = {
    "wide": "parameter group 0: embed.weight is [37, 14] in the checkpoint and [37, 13] in the model",
    "extra": "checkpoint parameter extra [3] is not a trainable parameter of the model",
    "fewer": "parameter group 0: parameter gain [1] of the model is not in the checkpoint",
    "reordered": "parameter 1 of the saved partitions is head.weight in the checkpoint and embed.weight in the model",
}


def _ok(jobs):
    assert all(j.returncode == 0 for j in jobs), next(j.output for j in jobs if j.returncode != 0)[-5000:]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load_exact")
    saved = tmp / "saved"
    saved.mkdir()
    _ok(run_plain(tmp, SCRIPT, 2, ["save", "--out", str(saved)], timeout=300, name="save"))
    _damage(saved / "ours_std", saved / "ours_damaged")
    for ws in LOAD_SIZES:
        out = tmp / f"load{ws}"
        out.mkdir()
        args = ["load", "--out", str(out), "--load-from", str(saved)]
        _ok(run_plain(tmp, SCRIPT, ws, args, timeout=400, name=f"load{ws}"))
    return tmp


def _damage(src, dst) -> None:
    """A copy of ``src`` with one bit of an fp32-master element of rank 1's optimizer file flipped:
    the module-state file rank 0 and 1 read first is intact, so DeepSpeed's own load (2 ranks)
    would install it before it met the damage."""
    import shutil

    from io_engine import read_footer

    shutil.copytree(src, dst)
    path = dst / "ckpt" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    item = next(it for it in read_footer(str(path)).items if (it.attrs.get("vps") or {}).get("kind") == "fp32")
    with open(path, "r+b") as f:
        f.seek(item.offset + 7)
        b = f.read(1)
        f.seek(item.offset + 7)
        f.write(bytes([b[0] ^ 0x40]))


def _unread(x, where="client"):
    """Paths of anything in ``x`` that is not plain data or a tensor (an unread placeholder)."""
    if isinstance(x, torch.Tensor) or x is None or isinstance(x, (bool, int, float, str)):
        return []
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _unread(v, f"{where}/{k}")]
    if isinstance(x, (list, tuple)):
        return [p for i, v in enumerate(x) for p in _unread(v, f"{where}/{i}")]
    return [f"{where}: {type(x).__name__}"]


def _assert_same(got, want, where="client"):
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        # bitwise: the bytes (-0.0 and 0.0, or NaNs, would pass torch.equal alone)
        raw = [t.contiguous().view(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*raw), where
    elif isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want, (where, got, want)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.parametrize("fmt", ["ours", "torch"])
@pytest.mark.parametrize("ws", LOAD_SIZES, ids=[f"2to{w}" for w in LOAD_SIZES])
def test_client_state_comes_back_exactly(loaded, ws, fmt, stage):
    from workers.load_exact_worker import client_state

    want = client_state()
    assert want["fp32_1mib"].numel() * 4 == 1 << 20  # not vacuous: far above a snapshot skeleton's tensors
    for rank in range(ws):
        got = torch.load(loaded / f"load{ws}" / f"client_{fmt}_z{stage}_rank{rank}.pt", weights_only=False)
        assert not _unread(got), _unread(got)
        _assert_same({k: got[k] for k in want}, want)
    # the route: resharded (a load record) at another world size, DeepSpeed's own at the saving one
    metrics = loaded / f"load{ws}" / f"metrics_client_{fmt}_z{stage}.jsonl"
    records = read_jsonl(metrics) if metrics.exists() else []  # no record, no file
    loads = [r for r in records if r["event"] == "load"]
    assert [(r["from"], r["to"]) for r in loads] == ([] if ws == 2 else [(2, ws)]), loads


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ws", LOAD_SIZES, ids=[f"2to{w}" for w in LOAD_SIZES])
def test_another_model_or_a_damaged_file_refused_once_per_rank_and_the_engine_unchanged(loaded, ws):
    out = loaded / f"load{ws}"
    results = [json.loads((out / f"trial_rank{r}.json").read_text()) for r in range(ws)]
    for rank, r in enumerate(results):
        damaged = r["errors"].pop("ours_damaged")
        assert damaged is not None and damaged["type"] == "CheckpointCorruptError", (rank, ws, damaged)
        assert damaged["message"].count("checksum mismatch for item") == 1, damaged["message"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in damaged["message"]
        for case, err in r["errors"].items():
            variant = case.split("_", 1)[1]
            where = f"rank {rank}, {case}, {ws} ranks"
            assert err is not None, f"{where}: loaded a checkpoint of another model"
            assert err["type"] == "LayoutMismatchError", (where, err)
            # the problem named once (every rank found it: not each rank's message repeated)
            assert err["message"].count(EXPECTED[variant]) == 1, (where, err["message"])
            assert err["message"].count("LayoutMismatchError") == 0, (where, err["message"])
            if ws > 1:
                assert "every rank: " + EXPECTED[variant] in err["message"], (where, err["message"])
        # the step after the refused loads is the step of an engine that never tried them
        assert r["trial_losses"] and r["trial_losses"] == r["reference_losses"], (rank, r)
    ref, trial = torch.load(out / "state_reference.pt"), torch.load(out / "state_trial.pt")
    names = [k for k in ref if not k.startswith("__")]
    assert names and sorted(names) == sorted(k for k in trial if not k.startswith("__"))
    for name in names:
        for kind in ("fp32", "exp_avg", "exp_avg_sq", "param"):
            assert torch.equal(ref[name][kind], trial[name][kind]), f"{name}.{kind}"
    assert ref["__step__"] == trial["__step__"] and ref["__global_steps__"] == trial["__global_steps__"] == 3
    assert ref["__lr__"] == trial["__lr__"]


def test_problems_named_once_with_their_ranks_and_our_common_class():
    """``elastic.collective.summarize`` (what ``raise_on_every_rank`` raises, from every rank's
    report): each distinct problem once with its ranks; one class of ours on every failing rank is
    raised as that class, anything else as the caller's."""
    from ds_dynatrain.elastic.collective import _wire, summarize
    from ds_dynatrain.errors import CheckpointCorruptError, CheckpointIncompleteError, LayoutMismatchError

    shape = LayoutMismatchError("embed.weight is [37, 14] in the checkpoint and [37, 13] in the model")
    cls, text = summarize([_wire(shape)] * 4, CheckpointIncompleteError)
    assert cls is LayoutMismatchError and text == f"every rank: {shape}"
    assert summarize([_wire(None)] * 3, CheckpointIncompleteError) is None
    corrupt = CheckpointCorruptError("f.pt: checksum mismatch for item t/3")
    cls, text = summarize([None, _wire(corrupt), None], CheckpointIncompleteError)
    assert cls is CheckpointCorruptError and text == f"rank 1: {corrupt}"
    # different classes, or a class not of ours: the caller's class, each problem's class named
    other = OSError("disk gone")
    cls, text = summarize([_wire(corrupt), _wire(other), _wire(corrupt)], CheckpointIncompleteError)
    assert cls is CheckpointIncompleteError
    assert text == f"ranks 0, 2: CheckpointCorruptError: {corrupt}; rank 1: OSError: {other}"
    cls, text = summarize([_wire("late"), None], CheckpointIncompleteError)  # a string: the caller's class
    assert cls is CheckpointIncompleteError and text == "rank 0: late"
    assert summarize([_wire(shape)], CheckpointIncompleteError) == (LayoutMismatchError, f"rank 0: {shape}")
