"""The way in from Trainer and Accelerate (``ds_dynatrain.frontends``): the routed
``deepspeed.initialize``, the guard on a section that reaches DeepSpeed another way, and Trainer's
checkpoint choices on real directories. The multi-process Trainer runs are in ``test_trainer.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import deepspeed
import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig

import ds_dynatrain
from ds_dynatrain.errors import ConfigError
from ds_dynatrain.frontends import last_complete_checkpoint, original_initialize, section_of
from ds_dynatrain.frontends.trainer import incomplete_reason, rotation_keeping_durable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_routes_deepspeed_initialize_once():
    before = deepspeed.initialize
    ds_dynatrain.frontends.install()  # idempotent
    assert deepspeed.initialize is before
    assert original_initialize() is not deepspeed.initialize
    assert original_initialize().__module__ == "deepspeed"


def test_a_section_reaching_deepspeed_by_another_road_is_refused():
    with pytest.raises(ConfigError, match="'dynatrain' section but this engine is being built by DeepSpeed directly"):
        DeepSpeedConfig({"train_batch_size": 1, "dynatrain": {}})
    assert DeepSpeedConfig({"train_batch_size": 1, "dynatrain": {"enabled": False}}).train_batch_size == 1
    assert DeepSpeedConfig({"train_batch_size": 2}).train_batch_size == 2


def test_a_sectioned_config_goes_to_ours_before_anything_is_built():
    """DeepSpeed knows no ``dynatrain`` keys: the error names ours, so the call reached ours."""
    model = torch.nn.Linear(2, 2)
    adam = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}  # a training engine: an optimizer
    config = {"train_batch_size": 2, "optimizer": adam, "dynatrain": {"snapshot": {"intervall": 2}}}
    for key in ("config", "config_params"):
        with pytest.raises(ConfigError, match=r"dynatrain\.snapshot\.intervall: unknown key"):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), **{key: config})
    with pytest.raises(ConfigError, match="device mesh"):
        deepspeed.initialize(model=model, config={"optimizer": adam, "dynatrain": {}}, mesh_param=(1, 2))
    with pytest.raises(ConfigError, match=r"dynatrain\.bogus: unknown key"):  # an evaluation engine's section too
        deepspeed.initialize(model=model, config={"train_batch_size": 2, "dynatrain": {"bogus": 1}})


def test_section_of_reads_every_form_deepspeed_accepts(tmp_path):
    cfg = {"train_batch_size": 4, "dynatrain": {"snapshot": {"interval_steps": 2}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert (
        section_of(cfg) == section_of(str(path)) == section_of(path) == section_of(json.dumps(cfg)) == cfg["dynatrain"]
    )
    assert section_of({"train_batch_size": 4}) is None
    assert section_of(str(tmp_path / "missing.json")) is None  # left to DeepSpeed, which names it
    assert section_of("{not json") is None
    assert section_of(None) is None


def _folder(root, name, files=(), dirs=()):
    path = root / name
    path.mkdir()
    for d in dirs:
        (path / d).mkdir()
    for f, text in files:
        (path / f).write_text(text)
    return str(path)


def test_last_complete_checkpoint_passes_over_unfinished_snapshots(tmp_path):
    plain = _folder(tmp_path, "checkpoint-2", files=[("trainer_state.json", "{}")])
    flushing = _folder(tmp_path, "checkpoint-4", files=[("trainer_state.json", "{}")], dirs=[".tmp-global_step4"])
    dangling = _folder(tmp_path, "checkpoint-6", files=[("latest", "global_step6")])
    _folder(tmp_path, "checkpoint-x")  # not Trainer's numbering
    (tmp_path / "checkpoint-8").write_text("a file, not a folder")
    assert incomplete_reason(plain) is None  # no DeepSpeed checkpoint in it: Trainer's own rule
    assert "no tag given and no 'latest' file" in incomplete_reason(flushing)
    assert "global_step6" in incomplete_reason(dangling)
    assert last_complete_checkpoint(str(tmp_path)) == plain
    assert last_complete_checkpoint(str(tmp_path / "checkpoint-x")) is None


def test_rotation_keeps_the_newest_complete_checkpoint_while_a_newer_one_flushes(tmp_path):
    from transformers.trainer_utils import sort_checkpoints

    rotate = rotation_keeping_durable(sort_checkpoints)
    _folder(tmp_path, "checkpoint-1", files=[("trainer_state.json", "{}")])
    _folder(tmp_path, "checkpoint-2", files=[("trainer_state.json", "{}")])
    _folder(tmp_path, "checkpoint-4", dirs=[".tmp-global_step4"])
    rotate(str(tmp_path), save_total_limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    _folder(tmp_path, "checkpoint-6", files=[("trainer_state.json", "{}")])
    rotate(str(tmp_path), save_total_limit=1, best_model_checkpoint=str(tmp_path / "checkpoint-2"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-6"]
    rotate(str(tmp_path), save_total_limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6"]


@pytest.mark.parametrize("order", ["ds_dynatrain first", pytest.param("transformers first", marks=pytest.mark.slow)])
def test_trainer_hooks_are_installed_whatever_the_import_order(order):
    first, second = ("ds_dynatrain", "transformers.trainer")
    if order == "transformers first":
        first, second = second, first
    code = (
        f"import {first}, {second}, transformers.trainer as t\n"
        "from ds_dynatrain.frontends.trainer import last_complete_checkpoint as l\n"
        "print(t.get_last_checkpoint.__wrapped__.__module__, t.get_last_checkpoint.__code__ is l.__code__,"
        " t.rotate_checkpoints.__code__.co_filename.endswith('frontends/trainer.py'))\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["transformers.trainer_utils", "True", "True"]


@pytest.mark.parametrize(
    "case,engine",
    [
        ("path", "ElasticEngine"),
        pytest.param("args", "ElasticEngine", marks=pytest.mark.slow),
        pytest.param("evaluation", "DeepSpeedEngine", marks=pytest.mark.slow),
    ],
)
def test_config_files_and_args_are_routed_as_deepspeed_reads_them(tmp_path, case, engine):
    """A config file (``config=PATH`` or ``args.deepspeed_config``) with an optimizer and no
    ``model_parameters`` builds ours (DeepSpeed takes ``model.parameters()``); without an
    optimizer, DeepSpeed's own, with the config only in ``config=`` (DeepSpeed refuses it twice)."""
    from tests.conftest import run_plain

    out = str(tmp_path / "out.json")
    worker = os.path.join(ROOT, "tests", "workers", "route_worker.py")
    (job,) = run_plain(tmp_path, worker, 1, ["--case", case, "--out", out], timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    with open(out) as f:
        got = json.load(f)
    assert got["engine"] == engine
    # ZeRO-3 without an optimizer: DeepSpeed's parameter manager alone
    assert got["optimizer"] == ("DeepSpeedZeRoOffload" if case == "evaluation" else "DeepSpeedZeroOptimizer")


def test_an_accelerator_that_drops_deepspeed_refuses_the_section():
    """Accelerate with cpu=True (or without --use_deepspeed) wraps the model in DDP and drops the
    DeepSpeed plugin silently; with a "dynatrain" section in its config that is an error."""
    code = (
        "import ds_dynatrain\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import DeepSpeedPlugin\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 1, 'train_batch_size': 2,"
        " 'zero_optimization': {'stage': 2}}\n"
        "plain = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(cfg)))\n"
        "print('plain', plain.distributed_type)\n"
        "Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(cfg, dynatrain={})))\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "plain DistributedType.NO" in out.stdout
    assert out.returncode != 0
    assert "ConfigError: this Accelerator does not use DeepSpeed (distributed type DistributedType.NO)" in out.stderr


def test_an_accelerator_that_drops_the_deepspeed_config_of_its_variables_refuses_the_section(tmp_path):
    """The same through Accelerate's variables (what `accelerate launch --deepspeed_config_file` and
    `dynatrain launch --deepspeed_config_file` set): cpu=True drops the config's section; an error."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "zero_optimization": {"stage": 2}, "dynatrain": {}}))
    code = "import ds_dynatrain\nfrom accelerate import Accelerator\nAccelerator(cpu=True)\n"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, ACCELERATE_USE_DEEPSPEED="true")
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "ConfigError: this Accelerator does not use DeepSpeed (distributed type DistributedType.NO)" in out.stderr
