"""A ZeRO-1/2 snapshot's model-state file leaves the trainable parameters to the fp32 master
(``snapshot.module_from_master``) and reading it gives them back bitwise.

Multi-process (``tests/workers/module_master_worker.py``, a 2-rank ZeRO-2 TinyLM job, fp32 and
bf16; a ZeRO-1 fp16 job of a model with a frozen embedding, tied input/output embeddings and two
parameter groups, marked slow): the same step saved stripped and whole. Oracles: the working parameters gathered with
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
from conftest import WORKERS, launch, skip_unless_torch_computes_fp16

pytestmark = pytest.mark.multiprocess

TRAINABLE = {"embed.weight", "mix.weight", "mix.bias", "norm.weight", "norm.bias", "gain", "head.weight", "head.bias"}
MODEL = "mp_rank_00_model_states.pt"
# a loss scale at which these small models' fp16 gradients do not overflow: the worker's count of
# skipped steps (steps 1-3 and the step after its load, which restored the count) is asserted 0
FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 3, "min_loss_scale": 1}


@pytest.mark.parametrize(
    "precision,stage,model",
    [
        ("fp32", 2, "tiny"),
        ("bf16", 2, "tiny"),
        pytest.param("fp16", 1, "groups", marks=pytest.mark.slow),
    ],
)
def test_model_state_file_without_working_parameters_reads_back_bitwise(tmp_path, precision, stage, model):
    from workers.common import VOCAB, base_config
    from workers.groups_worker import TRAINABLE_NAMES, GroupsLM

    from ds_dynatrain.checkpoint.module_master import MARKER
    from ds_dynatrain.checkpoint.state_file import read_state_file
    from ds_dynatrain.errors import CheckpointIncompleteError
    from io_engine import read_footer

    cfg = base_config(stage)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        skip_unless_torch_computes_fp16()
        cfg["fp16"] = dict(FP16)
    args = [str(tmp_path), "--model", model]
    job = launch(tmp_path, os.path.join(WORKERS, "module_master_worker.py"), 2, cfg, args, timeout=180)
    assert job.returncode == 0, job.output[-5000:]
    r = json.loads((tmp_path / "result.json").read_text())
    trainable = set(TRAINABLE_NAMES) if model == "groups" else TRAINABLE
    assert set(r["listed"]) == trainable and r["equal"] is True and r["step"] == 3 and r["skipped"] == 0
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)

    stripped, whole = tmp_path / "stripped" / "s3" / MODEL, tmp_path / "whole" / "s3" / MODEL
    # the stripped file's tensors are the whole one's less the trainable parameters (GroupsLM keeps
    # its frozen embedding and the tied head.weight, a name DeepSpeed's layout does not list); a save
    # right after a load writes the module whole, the one after the next step does not
    after_load = [tmp_path / "after_load" / tag / MODEL for tag in ("l3", "l4")]
    tensor_bytes = [
        sum(m.nbytes for m in read_footer(str(f)).items if m.kind == "tensor") for f in (stripped, whole, *after_load)
    ]
    trainable_bytes = sum(oracle[n].numel() for n in trainable) * torch.empty((), dtype=dtype).element_size()
    whole_bytes = tensor_bytes[1]
    assert tensor_bytes == [whole_bytes - trainable_bytes, whole_bytes, whole_bytes, whole_bytes - trainable_bytes]
    if model == "tiny":  # no buffers, nothing frozen or tied: the module is the trainable parameters
        assert whole_bytes == trainable_bytes
    else:  # and GroupsLM's frozen embedding (VOCAB x 5) and the tied head.weight (VOCAB x 11), fp16
        assert whole_bytes == trainable_bytes + VOCAB * (5 + 11) * 2
    assert torch.equal(read_state_file(str(after_load[0]))["module"]["mix.weight"].float(), oracle["mix.weight"])

    got, want = read_state_file(str(stripped)), read_state_file(str(whole))
    assert MARKER not in got and list(got) == list(want)
    assert list(got["module"]) == list(want["module"])
    for name, t in want["module"].items():
        assert got["module"][name].dtype == t.dtype and torch.equal(got["module"][name], t), name
    for name in trainable:
        # the oracle is the working parameter as fp32 (exact for bf16 and fp16)
        assert got["module"][name].dtype == dtype and torch.equal(got["module"][name].float(), oracle[name]), name
    if model == "groups":  # the frozen embedding as initialised (the worker's seed), in fp16
        torch.manual_seed(0)
        assert torch.equal(got["module"]["frozen.weight"], GroupsLM().frozen.weight.detach().half())

    # the stripped file needs the optimizer files; the whole one does not
    for src, ok in ((tmp_path / "stripped" / "s3", False), (tmp_path / "whole" / "s3", True)):
        damaged = tmp_path / f"damaged-{src.parent.name}" / "s3"
        shutil.copytree(src, damaged)
        (rank1,) = damaged.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")  # bf16: bf16_zero_pp_...
        rank1.unlink()
        if ok:
            assert torch.equal(
                read_state_file(str(damaged / MODEL))["module"]["mix.weight"].float(), oracle["mix.weight"]
            )
        else:
            with pytest.raises(
                CheckpointIncompleteError, match=f"trainable parameters to the fp32 master.*{rank1.name}: missing"
            ):
                read_state_file(str(damaged / MODEL))


def test_strip_keeps_entries_of_another_shape_and_the_state_it_was_given():
    """Only floating-point entries of the layout's shape are stripped (a state-dict hook may give a
    parameter another shape); the dict DeepSpeed passed is left as it was."""
    from ds_dynatrain.checkpoint.module_master import MARKER, strip_working

    module = {"a": torch.ones(2, 3), "b": torch.ones(6), "ids": torch.arange(4), "c": torch.ones(1)}
    state = {"module": module, "global_steps": 7}
    out = strip_working(state, {"a": (2, 3), "b": (2, 3), "ids": (4,), "gone": (1,)})
    assert out[MARKER] == ["a"] and out["module"]["a"].numel() == 0 and out["module"]["a"].dtype == torch.float32
    assert list(out["module"]) == list(module) and out["module"]["b"] is module["b"] and out["global_steps"] == 7
    assert state["module"] is module and module["a"].shape == (2, 3) and MARKER not in state
    assert strip_working(state, {"b": (2, 3)}) is state and strip_working({"x": 1}, {"a": (2, 3)}) == {"x": 1}
