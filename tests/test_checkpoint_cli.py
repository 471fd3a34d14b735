"""``dynatrain inspect``, ``verify`` and ``export`` on real checkpoints written by real engines (2
ranks, this project's snapshot format and DeepSpeed's ``torch.save`` format of the same state).

Oracles: the state gathered in the saving job with DeepSpeed's ``safe_get_full_*``, DeepSpeed's
own ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` on the DeepSpeed-format checkpoint,
the ``safetensors`` library (reading what the streaming writer wrote) and ``transformers``
(``from_pretrained`` of an exported Llama).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import ROOT, WORKERS, assert_no_gloo_thread, run_plain

CKPTS = [(fmt, stage) for stage in (1, 2, 3) for fmt in ("ours", "torch")]
TINYLM_PARAMS = {
    "gain": [1],
    "embed.weight": [37, 13],
    "mix.weight": [7, 13],
    "mix.bias": [7],
    "norm.weight": [7],
    "norm.bias": [7],
    "head.weight": [37, 7],
    "head.bias": [37],
}


@pytest.fixture(scope="module")
def tinylm(tmp_path_factory):
    """TinyLM after 3 steps on 2 ranks at ZeRO-1, 2 and 3: ``ours_z<s>/``, ``torch_z<s>/`` (tag
    ``ckpt``, ``latest`` names it) and ``state_z<s>.pt``."""
    out = tmp_path_factory.mktemp("tinylm")
    jobs = run_plain(
        out,
        os.path.join(WORKERS, "migrate_worker.py"),
        2,
        ["save", "--out", str(out), "--stages", "1,2,3"],
        timeout=150,
        name="save",
    )
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    return out


def test_the_saving_processes_end_with_no_gloo_thread_alive(tinylm):
    """Each rank built, trained and destroyed ZeRO-1, 2 and 3 engines; after the library's exit hooks
    no gloo thread is left to outlive the interpreter (one that did aborted a process after its
    work was done: "terminate called without an active exception", status -6)."""
    for r in range(2):
        assert_no_gloo_thread(tinylm / f"threads_rank{r}")


@pytest.fixture(scope="module")
def extras(tmp_path_factory):
    """A tied, partly frozen Llama at ZeRO-3 (``llama/``) and TinyLM with a frozen parameter and
    fp32/int64 buffers at ZeRO-2 and 1 (``extras/``, ``extras_z1/``), see ``workers/export_worker.py``."""
    pytest.importorskip("transformers", reason="the Llama checkpoint needs transformers")
    out = tmp_path_factory.mktemp("extras")
    jobs = run_plain(out, os.path.join(WORKERS, "export_worker.py"), 2, ["--out", str(out)], timeout=150, name="extras")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    return out


def cli(capsys, *argv):
    from ds_dynatrain.cli import main

    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def flip_byte(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def zero_to_fp32(ckpt_dir):
    """DeepSpeed's consolidation. Its ``torch.load(mmap=True)`` refuses the legacy (non-zip) files
    DeepSpeed's own default engine writes; those are loaded without mmap (same bytes)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    real = torch.load

    def load(f, *a, **k):
        if k.get("mmap") and not zipfile.is_zipfile(f):
            k["mmap"] = False
        return real(f, *a, **k)

    torch.load = load
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))
    finally:
        torch.load = real


# --- inspect ------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt,stage", CKPTS)
def test_inspect_reports_world_stage_step_and_parameters(tinylm, capsys, fmt, stage):
    d = tinylm / f"{fmt}_z{stage}"
    rc, out, err = cli(capsys, "inspect", d, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    state = torch.load(tinylm / f"state_z{stage}.pt")
    assert rep["format"] == ("dynatrain" if fmt == "ours" else "deepspeed")
    assert (rep["world_size"], rep["zero_stage"], rep["step"]) == (2, stage, state["__global_steps__"]) == (2, stage, 3)
    assert {p["name"]: p["shape"] for p in rep["parameters"]} == TINYLM_PARAMS
    assert rep["num_parameters"] == sum(v["fp32"].numel() for k, v in state.items() if not k.startswith("__")) == 890
    ckpt = d / "ckpt"
    for r in rep["ranks"]:
        assert r["bytes"] == sum(os.path.getsize(ckpt / f) for f in r["files"])
        assert f"zero_pp_rank_{r['rank']}_mp_rank_00_optim_states.pt" in r["files"]
    assert rep["total_bytes"] == sum(os.path.getsize(ckpt / f) for f in os.listdir(ckpt))
    rc, out, _ = cli(capsys, "inspect", d, "--tag", "ckpt")
    assert rc == 0
    assert re.search(r"world size\s+2\n", out) and re.search(rf"ZeRO stage\s+{stage}\n", out)
    assert re.search(r"step\s+3 ", out) and "890 elements in 8 tensors" in out and "embed.weight" in out


# --- verify -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt,stage", CKPTS)
def test_verify_passes_intact_checkpoints(tinylm, capsys, fmt, stage):
    from ds_dynatrain.checkpoint.consolidate import saved_layout
    from ds_dynatrain.checkpoint.saved import SavedCheckpoint

    rc, out, err = cli(capsys, "verify", tinylm / f"{fmt}_z{stage}")
    assert rc == 0, err
    assert "is complete and intact" in out and "every element held exactly once" in out
    if fmt == "ours":
        assert "every checksum matches" in out and "checksums not available" not in out
    else:
        assert "checksums not available" in out
    saved = SavedCheckpoint(str(tinylm / f"{fmt}_z{stage}"))
    try:  # the metadata-only layout verify and export use is the loader's
        assert saved_layout(saved) == saved.layout_from_metadata()
    finally:
        saved.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_verify_finds_a_flipped_byte_in_every_item(tinylm, tmp_path, stage):
    """One byte flipped in the middle of each item of each file in turn (tensors and the
    serialized skeleton): verify fails, naming the file and the item."""
    from ds_dynatrain.checkpoint.inspect import verify_checkpoint
    from io_engine import read_footer

    d = copy_ckpt(tinylm / f"ours_z{stage}", tmp_path / "ckpt")
    tried = 0
    for name in sorted(os.listdir(d / "ckpt")):
        path = d / "ckpt" / name
        for it in read_footer(str(path)).items:
            if not it.nbytes:
                continue
            at = it.offset + it.nbytes // 2
            flip_byte(path, at)
            try:
                rep = verify_checkpoint(str(d))
            finally:
                flip_byte(path, at)
            assert not rep.ok, (name, it.key)
            hit = [p for p in rep.problems if name in p and re.search(rf"item '?{re.escape(it.key)}\b", p)]
            assert hit, (name, it.key, rep.problems)
            tried += 1
    # every non-empty item of every file: ZeRO-3 module tensors are empty, and so are ZeRO-2's
    # trainable ones (left to the fp32 master, snapshot.module_from_master)
    assert tried == {2: 11, 3: 36}[stage]
    assert verify_checkpoint(str(d)).ok  # every byte restored


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_verify_cli_exit_status_on_a_flipped_tensor_byte(tinylm, tmp_path):
    """The installed entry point: status 1 and the file and item on stderr; 2 for bad usage."""
    from io_engine import read_footer

    d = copy_ckpt(tinylm / "ours_z2", tmp_path / "ckpt")
    path = d / "ckpt" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    item = next(
        it for it in read_footer(str(path)).items if (it.attrs.get("vps") or {}).get("kind") == "fp32"
    )  # the fp32 master partition
    flip_byte(path, item.offset + 4 * 17 + 2, 0x40)
    run = [sys.executable, "-m", "ds_dynatrain.cli"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    p = subprocess.run(run + ["verify", str(d)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"zero_pp_rank_1_mp_rank_00_optim_states.pt: item {item.key} " in p.stderr
    assert "checksum mismatch" in p.stderr and "FAILED" in p.stderr
    p = subprocess.run(
        run + ["verify", str(tmp_path / "absent")], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert p.returncode == 2 and "not a directory" in p.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("eager", ["read lazily by ranges", "read with the skeleton"])
def test_export_and_inspect_refuse_a_flipped_bit_in_a_master_partition(tinylm, tmp_path, capsys, monkeypatch, eager):
    """One bit of an fp32-master element flipped (the 6e36 weight of a sign-exponent flip): export
    writes nothing and inspect reports nothing, each with the file, the item and the byte range;
    with ``EAGER_BYTES`` at 0 (a seam: every tensor becomes a lazy range read, as a large model's
    are) the range read checks the block it reads."""
    from ds_dynatrain import CheckpointCorruptError
    from ds_dynatrain.checkpoint import saved_file
    from ds_dynatrain.checkpoint.consolidate import export_safetensors
    from ds_dynatrain.checkpoint.inspect import inspect_report
    from io_engine import read_footer

    if eager == "read lazily by ranges":
        monkeypatch.setattr(saved_file, "EAGER_BYTES", 0)
    d = copy_ckpt(tinylm / "ours_z2", tmp_path / "ckpt")
    path = d / "ckpt" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    item = next(it for it in read_footer(str(path)).items if (it.attrs.get("vps") or {}).get("kind") == "fp32")
    flip_byte(path, item.offset + 4 * 3 + 3, 0x40)  # the exponent's top bit of element 3
    out = tmp_path / "w.safetensors"
    where = rf"zero_pp_rank_1_mp_rank_00_optim_states.pt: item {item.key} .* checksum mismatch in the bytes from offset"
    with pytest.raises(CheckpointCorruptError, match=where):
        export_safetensors(str(d), str(out))  # every checksum first, then the export
    if eager == "read lazily by ranges":  # the range a resharded load or export reads is checked itself
        f = saved_file.SavedFile(str(path))
        ref = f.tree["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
        assert isinstance(ref, saved_file.TensorRef)
        at = rf"{re.escape(str(path))}: checksum mismatch for item '{item.key}', bytes \[{item.offset}, "
        with pytest.raises(CheckpointCorruptError, match=at):
            f.read_into([(ref, 2, torch.empty(4, dtype=torch.float32))])
        f.close()
    assert not out.exists() and not any(p.name.startswith(out.name) for p in tmp_path.iterdir())
    with pytest.raises(CheckpointCorruptError, match=f"item {item.key}"):
        inspect_report(str(d))
    rc, _out, err = cli(capsys, "export", d, "--out", out)
    assert rc == 1 and "checksum mismatch" in err and not out.exists()
    rc, _out, err = cli(capsys, "inspect", d)
    assert rc == 1 and "checksum mismatch" in err
    flip_byte(path, item.offset + 4 * 3 + 3, 0x40)
    assert inspect_report(str(d))["world_size"] == 2  # intact again: both read it


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "latest, why",
    [
        (b"\xff\xfe\x00garbage", "is not UTF-8 text"),
        (b"", "is empty"),
        (b"  \n", "is empty"),
        (b"/etc", "a path rather than a tag"),
        (b"../ours_z2/ckpt", "a path rather than a tag"),
        (b"..", "a path rather than a tag"),
        (b"global_step99", "has no such directory"),
    ],
)
def test_a_bad_latest_is_refused_by_every_reader(tinylm, tmp_path, capsys, latest, why):
    """``latest`` must name a tag directory of the checkpoint directory: garbage, an empty file, a
    path or a missing tag is one clear error from inspect, verify, export and the loaders' tag
    resolution (never a traceback, never a directory elsewhere)."""
    from ds_dynatrain import CheckpointIncompleteError
    from ds_dynatrain.checkpoint.saved import SavedCheckpoint

    d = copy_ckpt(tinylm / "ours_z2", tmp_path / "ckpt")
    (d / "latest").write_bytes(latest)
    for argv in (["inspect", d], ["verify", d], ["export", d, "--out", tmp_path / "w.safetensors"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 1 and why in err and "Traceback" not in err, (argv, err)
        assert "latest" in err
    with pytest.raises(CheckpointIncompleteError, match=why):
        SavedCheckpoint(str(d))
    assert SavedCheckpoint(str(d), "ckpt").world_size == 2  # an explicit tag still serves
    with pytest.raises(CheckpointIncompleteError, match="a path rather than a tag"):
        SavedCheckpoint(str(d), "../ckpt")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_usage_errors_exit_2(tinylm, tmp_path, capsys):
    from ds_dynatrain.cli import main

    d = tinylm / "ours_z2"
    for argv in (
        ["export", d, "--out", tmp_path / "w.safetensors", "--dtype", "fp8"],
        ["verify"],
        ["inspect", d, "-x"],
    ):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        assert e.value.code == 2
    rc, _out, err = cli(capsys, "export", d, "--out", tmp_path / "no" / "w.safetensors")
    assert rc == 2 and "does not exist" in err
    rc, _out, err = cli(capsys, "inspect", tmp_path / "absent")
    assert rc == 2 and "not a directory" in err
    rc, _out, err = cli(capsys, "verify", d, "--tag", "global_step9")  # a tag that was never saved
    assert rc == 1 and "global_step9" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt", ["ours", "torch"])
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_verify_fails_on_truncated_or_missing_rank_file(tinylm, tmp_path, capsys, fmt, damage):
    d = copy_ckpt(tinylm / f"{fmt}_z2", tmp_path / "ckpt")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path = d / "ckpt" / name
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 100)
    else:
        os.unlink(path)
    rc, _out, err = cli(capsys, "verify", d)
    assert rc == 1
    assert name in err and "FAILED" in err
    assert ("missing" if damage == "missing" else ("damaged" if fmt == "ours" else "unexpected EOF")) in err
    rc, _out, err = cli(capsys, "export", d, "--out", tmp_path / "w.safetensors")
    assert rc == 1 and name in err and not os.path.exists(tmp_path / "w.safetensors")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "stage,name,where",
    [
        (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "Adam step"),
        (3, "zero_pp_rank_1_mp_rank_00_model_states.pt", "global_steps"),
    ],
)
def test_a_file_of_another_save_is_refused_by_every_reader(tinylm, tmp_path, capsys, stage, name, where):
    """One rank's file from an earlier save of the same job (its step rewritten to 2, the save's is 3):
    DeepSpeed's format has no checksum to catch it; the steps do."""
    from ds_dynatrain import CheckpointIncompleteError
    from ds_dynatrain.checkpoint.saved import SavedCheckpoint

    d = copy_ckpt(tinylm / f"torch_z{stage}", tmp_path / "ckpt")
    path = d / "ckpt" / name
    tree = torch.load(path, weights_only=False)
    if where == "global_steps":
        assert tree["global_steps"] == 3
        tree["global_steps"] = 2
    else:
        base = tree["optimizer_state_dict"]["base_optimizer_state"]
        groups = base["state"] if isinstance(base, dict) else dict(enumerate(base))  # torch's or DeepSpeed's list
        assert [int(g["step"]) for g in groups.values()] == [3]
        groups[0]["step"] = torch.tensor(2.0)
    torch.save(tree, path)
    with pytest.raises(
        CheckpointIncompleteError, match=f"mixes files of several saves: {where} 2 in {name}; {where} 3 in"
    ):
        SavedCheckpoint(str(d))
    rc, _out, err = cli(capsys, "verify", d)
    assert rc == 1 and "mixes files of several saves" in err and name in err
    rc, _out, err = cli(capsys, "export", d, "--out", tmp_path / "w.safetensors")
    assert rc == 1 and name in err and not os.path.exists(tmp_path / "w.safetensors")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_verify_fails_on_a_partition_too_short_for_its_fragments(tinylm, tmp_path, capsys):
    """DeepSpeed's format has no checksums; a partition cut short is still found by the layout
    check (and export refuses it, leaving no file)."""
    d = copy_ckpt(tinylm / "torch_z3", tmp_path / "ckpt")
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = torch.load(d / "ckpt" / name, weights_only=False)
    flat = sd["optimizer_state_dict"]["fp32_flat_groups"]
    flat[2] = flat[2][:-5].clone()
    torch.save(sd, d / "ckpt" / name, _use_new_zipfile_serialization=False)
    rc, _out, err = cli(capsys, "verify", d)
    assert rc == 1
    assert re.search(
        rf"{name}: partition 2 \(fp32\) has {flat[2].numel()} elements; its fragments .* need "
        rf"{flat[2].numel() + 5}",
        err,
    ), err
    rc, _out, err = cli(capsys, "export", d, "--out", tmp_path / "w.safetensors")
    assert rc == 1 and name in err and not os.path.exists(tmp_path / "w.safetensors")


def test_coverage_check_finds_gaps_and_overlaps():
    """The tiling check itself (pure): a layout whose fragments leave a gap or overlap is refused,
    naming the parameter and the elements."""
    from ds_dynatrain.checkpoint.consolidate import coverage_problems
    from ds_dynatrain.vps.layout import Fragment, ParamMeta, ZeroLayout

    good = ZeroLayout(2, ((ParamMeta("a", (5, 3), "float32"), ParamMeta("b", (7,), "float32")),), stage=2)
    assert coverage_problems(good) == []

    class Broken(ZeroLayout):
        def fragments(self, rank):
            frags = list(super().fragments(rank))
            if rank == 1:
                f = frags[0]  # rank 1's first fragment, shifted one element back: an overlap and a gap
                frags[0] = Fragment(f.group, f.key, f.start - 1, f.numel, f.local)
            return tuple(frags)

    bad = Broken(2, good.groups, stage=2)
    problems = coverage_problems(bad)
    key = good.fragments(1)[0].key
    assert any(re.search(rf"parameter {key} .*held twice", p) for p in problems), problems
    assert any(re.search(rf"parameter {key} .*held by no rank", p) for p in problems), problems


# --- export -------------------------------------------------------------------------------------


def _export(capsys, d, out, *extra):
    rc, stdout, err = cli(capsys, "export", d, "--out", out, *extra)
    assert rc == 0, err
    assert f"wrote {out}" in stdout
    from safetensors.torch import load_file

    return load_file(str(out))


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_equals_zero_to_fp32_and_the_gathered_state(tinylm, tmp_path, capsys, stage):
    from safetensors import safe_open

    ref = zero_to_fp32(tinylm / f"torch_z{stage}")
    state = torch.load(tinylm / f"state_z{stage}.pt")
    ours = _export(capsys, tinylm / f"ours_z{stage}", tmp_path / "ours.safetensors")
    theirs = _export(capsys, tinylm / f"torch_z{stage}", tmp_path / "torch.safetensors", "--tag", "ckpt")
    assert list(ours) == list(theirs) == list(ref) == list(TINYLM_PARAMS)
    for k in ref:
        assert ours[k].dtype == torch.float32 and ours[k].shape == ref[k].shape
        assert torch.equal(ours[k], ref[k]) and torch.equal(theirs[k], ref[k]), k
        assert torch.equal(ours[k], state[k]["fp32"]), k
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["step"] == "3" and meta["zero_stage"] == str(stage)
        assert f.get_slice("embed.weight").get_shape() == [37, 13]
    bf16 = _export(capsys, tinylm / f"ours_z{stage}", tmp_path / "bf16.safetensors", "--dtype", "bf16")
    assert list(bf16) == list(ref)
    for k in ref:
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], ours[k].to(torch.bfloat16)), k
    assert os.path.getsize(tmp_path / "bf16.safetensors") < os.path.getsize(tmp_path / "ours.safetensors")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "which", ["tinylm/ours_z2", "tinylm/ours_z3", "extras/llama/ours", "extras/extras/ours", "extras/extras_z1/torch"]
)
def test_export_by_ranges_and_small_chunks_writes_the_same_file(tinylm, extras, tmp_path, capsys, monkeypatch, which):
    """Large tensors of this project's files are left unread when a file is opened and fetched
    by byte range (here every tensor, as if all were large), in chunks (here 7 elements: every
    fragment cut, ends unaligned): the very same bytes as reading them whole. verify reads
    such files alike."""
    import ds_dynatrain.checkpoint.consolidate as consolidate
    import ds_dynatrain.checkpoint.saved_file as migrate

    root, rest = which.split("/", 1)
    d = (tinylm if root == "tinylm" else extras) / rest
    _export(capsys, d, tmp_path / "whole.safetensors")
    monkeypatch.setattr(consolidate, "CHUNK_ELEMENTS", 7)
    monkeypatch.setattr(migrate, "EAGER_BYTES", 0)
    _export(capsys, d, tmp_path / "chunked.safetensors")
    assert (tmp_path / "whole.safetensors").read_bytes() == (tmp_path / "chunked.safetensors").read_bytes()
    rc, _out, err = cli(capsys, "verify", d)
    assert rc == 0, err


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["llama", "extras", "extras_z1"])
def test_export_tied_frozen_and_buffers_like_zero_to_fp32(extras, tmp_path, capsys, kind):
    """ZeRO-3 Llama: the tied lm_head under both names, the frozen norm from every rank's
    fragments. ZeRO-2 TinyLM: the frozen parameter and the fp32 and int64 buffers from ``module``.
    Same names, dtypes and values as DeepSpeed's consolidation, for both formats; bf16 leaves the
    int64 buffer int64. At ZeRO-1 DeepSpeed records no frozen parameters and its consolidation
    leaves them out; export takes them from ``module``, all else equal."""
    ref = zero_to_fp32(extras / kind / "torch")
    state = torch.load(extras / kind / "state.pt")
    if kind == "extras_z1":
        assert "bias_frozen" not in ref
        ref["bias_frozen"] = state["__frozen__"]["bias_frozen"]
    ours = _export(capsys, extras / kind / "ours", tmp_path / "ours.safetensors")
    theirs = _export(capsys, extras / kind / "torch", tmp_path / "torch.safetensors")
    assert sorted(ours) == sorted(theirs) == sorted(ref)
    assert list(ours) == list(theirs)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]) and torch.equal(theirs[k], ref[k]), k
    for k, v in state["__frozen__"].items():
        assert torch.equal(ours[k], v), k
    rc, out, err = cli(capsys, "inspect", extras / kind / "ours", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert [p["name"] for p in rep["parameters"] if not p["trainable"]] == list(state["__frozen__"])
    assert rep["buffers"] == ([] if kind == "llama" else ["scale", "seen"])  # Llama's rotary buffers: non-persistent
    assert rep["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if kind == "llama" else {})
    if kind == "llama":
        assert "lm_head.weight" in ours and torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])
        assert list(state["__frozen__"]) == ["model.norm.weight"]
    else:
        assert set(state["__frozen__"]) == {"bias_frozen"}
        for k, v in state["__buffers__"].items():
            assert torch.equal(ours[k], v), k
        bf16 = _export(capsys, extras / kind / "ours", tmp_path / "bf16.safetensors", "--dtype", "bf16")
        assert bf16["seen"].dtype == torch.int64 and torch.equal(bf16["seen"], ours["seen"])
        assert bf16["scale"].dtype == torch.bfloat16 and torch.equal(bf16["scale"], ours["scale"].bfloat16())


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt", ["ours", "torch"])
def test_exported_llama_loads_with_transformers(extras, tmp_path, capsys, fmt):
    """``dynatrain export`` alone makes a Hugging Face model directory: the snapshot holds the
    model's config and export writes it as ``config.json`` (equal to what ``save_pretrained``
    wrote in the job); ``from_pretrained`` finds every weight (none missing or unexpected), the
    master weights bitwise, the tie kept. Both formats: the config travels in the client state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "hf"
    out.mkdir()
    rc, stdout, err = cli(capsys, "export", extras / "llama" / fmt, "--out", out / "model.safetensors")
    assert rc == 0, err
    assert f"wrote {out / 'config.json'}" in stdout
    saved = LlamaConfig.from_pretrained(str(extras / "llama")).to_dict()
    exported = LlamaConfig.from_pretrained(str(out)).to_dict()
    assert exported == saved
    model, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = torch.load(extras / "llama" / "state.pt")
    sd = model.state_dict()
    trainable = [k for k in state if not k.startswith("__")]
    assert len(trainable) == 19
    for k in trainable:
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], state[k]["fp32"]), k
    assert torch.equal(sd["model.norm.weight"], state["__frozen__"]["model.norm.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_export_of_a_model_without_config_writes_no_config_json(tinylm, tmp_path, capsys):
    """TinyLM has no Hugging Face config: nothing is invented."""
    out = tmp_path / "plain"
    out.mkdir()
    _export(capsys, tinylm / "ours_z2", out / "model.safetensors")
    assert sorted(os.listdir(out)) == ["model.safetensors"]


# --- the writer alone -----------------------------------------------------------------------------


def test_safetensors_writer_any_order_any_dtype(tmp_path):
    """Tensors of several dtypes (an empty one too), written piecewise in reverse order, read back
    equal by the safetensors library; an incomplete tensor is refused and leaves no file."""
    from safetensors.torch import load_file

    from ds_dynatrain.checkpoint.consolidate import ExportEntry, SafetensorsWriter
    from ds_dynatrain.errors import CheckpointIncompleteError

    g = torch.Generator().manual_seed(3)
    want = {
        "w": torch.randn(5, 3, generator=g),
        "h": torch.randn(4, generator=g).bfloat16(),
        "ids": torch.arange(-3, 6, dtype=torch.int64).reshape(3, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "half": torch.randn(2, 2, generator=g).half(),
    }
    entries = [ExportEntry(k, v.dtype, tuple(v.shape), "module") for k, v in want.items()]
    path = tmp_path / "t.safetensors"
    w = SafetensorsWriter(str(path), entries, {"format": "pt"})
    assert w.data_start % 8 == 0
    for k, v in reversed(list(want.items())):
        flat = v.reshape(-1)
        for s in reversed(range(0, flat.numel(), 2)):
            w.write(k, s, flat[s : s + 2])
    w.commit()
    got = load_file(str(path))
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    w = SafetensorsWriter(str(tmp_path / "u.safetensors"), entries[:1], {})
    w.write("w", 0, want["w"].reshape(-1)[:14])
    with pytest.raises(CheckpointIncompleteError, match=r"tensor w: 14 of its 15 elements"):
        w.commit()
    assert sorted(os.listdir(tmp_path)) == ["t.safetensors"]
    w = SafetensorsWriter(str(tmp_path / "v.safetensors"), entries[:1], {})
    with pytest.raises(ValueError, match=r"tensor w: elements \[14, 16\) lie outside its 15"):
        w.write("w", 14, torch.zeros(2))
    w.abort()
