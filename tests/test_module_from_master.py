"""A ZeRO-1/2 snapshot's model-state file leaves the trainable parameters to the fp32 master
(``snapshot.module_from_master``) and reading it gives them back bitwise.

Multi-process (``tests/workers/module_master_worker.py``, a 2-rank ZeRO-2 TinyLM job, fp32 and
bf16): the same step saved stripped and whole. Oracles: the working parameters gathered with
DeepSpeed's own accessors at that step (the stripped file read back equals them, dtype included,
and equals the whole file read back, key order included), and the state after DeepSpeed's own load
of the stripped snapshot equals the state at the save, bitwise.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import WORKERS, launch

pytestmark = pytest.mark.multiprocess

TRAINABLE = {"embed.weight", "mix.weight", "mix.bias", "norm.weight", "norm.bias", "gain", "head.weight", "head.bias"}
MODEL = "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_state_file_without_working_parameters_reads_back_bitwise(tmp_path, precision):
    from workers.common import base_config

    from ds_dynatrain.checkpoint.module_master import MARKER
    from ds_dynatrain.checkpoint.state_file import read_state_file
    from ds_dynatrain.errors import CheckpointIncompleteError
    from io_engine import read_footer

    cfg = base_config(2)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    job = launch(tmp_path, os.path.join(WORKERS, "module_master_worker.py"), 2, cfg, [str(tmp_path)], timeout=180)
    assert job.returncode == 0, job.output[-5000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert set(r["listed"]) == TRAINABLE and r["equal"] is True and r["step"] == 3
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)

    stripped, whole = tmp_path / "stripped" / "s3" / MODEL, tmp_path / "whole" / "s3" / MODEL
    # TinyLM has no buffers: the whole file's tensors are the module's parameters, the stripped one's none
    tensor_bytes = [sum(m.nbytes for m in read_footer(str(f)).items if m.kind == "tensor") for f in (stripped, whole)]
    assert tensor_bytes == [0, sum(t.numel() for t in oracle.values()) * torch.empty((), dtype=dtype).element_size()]

    got, want = read_state_file(str(stripped)), read_state_file(str(whole))
    assert MARKER not in got and list(got) == list(want)
    assert list(got["module"]) == list(want["module"])
    for name, t in want["module"].items():
        assert got["module"][name].dtype == t.dtype and torch.equal(got["module"][name], t), name
    for name in TRAINABLE:
        # the oracle is the working parameter as fp32 (exact for bf16)
        assert got["module"][name].dtype == dtype and torch.equal(got["module"][name].float(), oracle[name]), name

    # the stripped file needs the optimizer files; the whole one does not
    for src, ok in ((tmp_path / "stripped" / "s3", False), (tmp_path / "whole" / "s3", True)):
        damaged = tmp_path / f"damaged-{src.parent.name}" / "s3"
        shutil.copytree(src, damaged)
        (rank1,) = damaged.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")  # bf16: bf16_zero_pp_...
        rank1.unlink()
        if ok:
            assert torch.equal(
                read_state_file(str(damaged / MODEL))["module"]["head.weight"].float(), oracle["head.weight"]
            )
        else:
            with pytest.raises(CheckpointIncompleteError, match=f"{rank1.name}: missing"):
                read_state_file(str(damaged / MODEL))
