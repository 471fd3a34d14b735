"""The ``"dynatrain"`` config section (``ds_dynatrain.config``) and the batch keys of the DeepSpeed
config (``ds_dynatrain.initialize.resolve_global_batch``; ``initialize()`` itself is not called)."""

import copy
import json
import re

import pytest
from pydantic import ValidationError

from ds_dynatrain.config import (
    DynatrainConfig,
    ResizeEvent,
    SnapshotConfig,
    load_ds_config,
    parse_section,
    resolve_global_batch,
)
from ds_dynatrain.errors import ConfigError, DynatrainError

FULL_SECTION = {
    "enabled": True,
    "resize_schedule": [{"step": 20, "world_size": 3}, {"step": 40, "world_size": 1}],
    "max_world_size": 4,
    "snapshot": {"interval_steps": 25, "dir": "runs/snapshots", "keep_last": 3},
    "metrics_path": "runs/metrics.jsonl",
    "log_interval_steps": 5,
    "collective_timeout_s": 30.5,
    "join_timeout_s": 120,
    "spawn_lookahead_steps": 0,
    "max_inflight_bytes": 1 << 20,
    "transfer_overlap": "step",
    "leaver_nice": 0,
}

DS_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
}


# ---------------------------------------------------------------- the section


def test_full_section_accepted():
    cfg = parse_section(copy.deepcopy(FULL_SECTION))
    assert cfg.enabled is True
    assert cfg.resize_schedule == [ResizeEvent(step=20, world_size=3), ResizeEvent(step=40, world_size=1)]
    assert cfg.max_world_size == 4
    assert cfg.snapshot == SnapshotConfig(interval_steps=25, dir="runs/snapshots", keep_last=3)
    assert cfg.metrics_path == "runs/metrics.jsonl"
    assert cfg.log_interval_steps == 5
    assert cfg.collective_timeout_s == 30.5
    assert cfg.join_timeout_s == 120.0
    assert cfg.spawn_lookahead_steps == 0


@pytest.mark.parametrize("section", [None, {}], ids=["absent", "empty"])
def test_defaults(section):
    cfg = parse_section(section)
    assert cfg == DynatrainConfig()
    assert cfg.enabled is True and cfg.resize_schedule == [] and cfg.max_world_size is None
    assert cfg.snapshot.interval_steps == 0 and cfg.snapshot.dir is None and cfg.snapshot.keep_last == 2
    assert cfg.metrics_path is None
    assert cfg.log_interval_steps == 1
    assert cfg.dist_backend is None  # the accelerator's backend


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_dist_backend_accepted(backend):
    assert parse_section({"dist_backend": backend}).dist_backend == backend


# (section, the located message the error must contain)
REFUSED = [
    ({"snapshot": {"intervall": 5}}, "dynatrain.snapshot.intervall: unknown key"),
    ({"resize_shedule": []}, "dynatrain.resize_shedule: unknown key"),
    ({"resize_schedule": [{"step": 3, "world_size": 2, "when": 1}]}, "dynatrain.resize_schedule.0.when: unknown key"),
    ({"max_world_size": "4"}, "dynatrain.max_world_size:"),
    ({"max_world_size": 4.0}, "dynatrain.max_world_size:"),
    ({"max_world_size": 0}, "dynatrain.max_world_size:"),
    ({"enabled": "yes"}, "dynatrain.enabled:"),
    ({"enabled": 1}, "dynatrain.enabled:"),
    ({"snapshot": {"interval_steps": "10", "dir": "d"}}, "dynatrain.snapshot.interval_steps:"),
    ({"snapshot": {"keep_last": 0}}, "dynatrain.snapshot.keep_last:"),
    ({"snapshot": []}, "dynatrain.snapshot:"),
    ({"resize_schedule": [{"step": True, "world_size": 2}]}, "dynatrain.resize_schedule.0.step:"),
    ({"resize_schedule": [{"step": 5, "world_size": 0}]}, "dynatrain.resize_schedule.0.world_size:"),
    ({"resize_schedule": [{"step": 5}]}, "dynatrain.resize_schedule.0.world_size:"),
    ({"resize_schedule": {"step": 5, "world_size": 2}}, "dynatrain.resize_schedule:"),
    ({"collective_timeout_s": 0}, "dynatrain.collective_timeout_s:"),
    ({"collective_timeout_s": "30"}, "dynatrain.collective_timeout_s:"),
    ({"metrics_path": 3}, "dynatrain.metrics_path:"),
    (
        {"resize_schedule": [{"step": 20, "world_size": 3}, {"step": 20, "world_size": 1}]},
        "resize_schedule steps must increase strictly; got 20 then 20",
    ),
    (
        {"resize_schedule": [{"step": 20, "world_size": 3}, {"step": 10, "world_size": 1}]},
        "resize_schedule steps must increase strictly; got 20 then 10",
    ),
    (
        {"resize_schedule": [{"step": 1, "world_size": 3}, {"step": 9, "world_size": 2}, {"step": 4, "world_size": 1}]},
        "got 9 then 4",
    ),
    ({"transfer_overlap": "forward"}, "dynatrain.transfer_overlap:"),
    ({"max_inflight_bytes": 16}, "dynatrain.max_inflight_bytes:"),
    ({"max_inflight_bytes": 1.5e9}, "dynatrain.max_inflight_bytes:"),
    ({"leaver_nice": 20}, "dynatrain.leaver_nice:"),
    ({"dist_backend": "glooo"}, "dynatrain.dist_backend:"),
    ({"dist_backend": ""}, "dynatrain.dist_backend:"),
    ({"snapshot": {"interval_steps": 5}}, "snapshot.dir is required when snapshot.interval_steps > 0"),
    ({"snapshot": {"interval_steps": 5, "dir": ""}}, "snapshot.dir is required"),
]


@pytest.mark.parametrize("section, message", REFUSED, ids=[json.dumps(s) for s, _ in REFUSED])
def test_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        parse_section(section)
    assert isinstance(info.value, DynatrainError)


def test_every_offending_key_is_named():
    with pytest.raises(ConfigError) as info:
        parse_section({"snapshot": {"intervall": 5}, "max_world_size": "x", "bogus": 1})
    msg = str(info.value)
    for key in ("dynatrain.snapshot.intervall", "dynatrain.max_world_size", "dynatrain.bogus"):
        assert key in msg


def test_snapshot_interval_zero_needs_no_dir():
    assert parse_section({"snapshot": {"interval_steps": 0}}).snapshot.dir is None


@pytest.mark.parametrize("section", [[], "dynatrain", 3], ids=["list", "str", "int"])
def test_section_must_be_an_object(section):
    with pytest.raises(ConfigError, match="'dynatrain' must be an object"):
        parse_section(section)


def test_config_is_frozen():
    cfg = parse_section({"max_world_size": 4})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.max_world_size = 8
    assert cfg.max_world_size == 4


# ---------------------------------------------------------------- load_ds_config


def test_load_strips_section_from_dict():
    config = dict(DS_CONFIG, dynatrain=copy.deepcopy(FULL_SECTION))
    before = copy.deepcopy(config)
    ds, dt = load_ds_config(config)
    assert ds == DS_CONFIG
    assert "dynatrain" not in ds
    assert dt == parse_section(FULL_SECTION)
    assert config == before  # the caller's dict is untouched
    ds["optimizer"]["params"]["lr"] = 5.0  # and not shared (deep copy)
    assert config["optimizer"]["params"]["lr"] == 1e-3


def test_load_without_section():
    ds, dt = load_ds_config(copy.deepcopy(DS_CONFIG))
    assert ds == DS_CONFIG and dt == DynatrainConfig()


def test_load_from_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(DS_CONFIG, dynatrain={"max_world_size": 8})))
    for arg in (path, str(path)):
        ds, dt = load_ds_config(arg)
        assert ds == DS_CONFIG
        assert dt.max_world_size == 8


def test_load_invalid_section_from_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(DS_CONFIG, dynatrain={"snapshot": {"intervall": 3}})))
    with pytest.raises(ConfigError, match=re.escape("dynatrain.snapshot.intervall: unknown key")):
        load_ds_config(path)


def test_load_unreadable_paths(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config") as info:
        load_ds_config(str(missing))
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config"):
        load_ds_config(tmp_path)  # a directory
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 16,')
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config") as info:
        load_ds_config(bad)
    assert "bad.json" in str(info.value)


@pytest.mark.parametrize("config", [[1, 2], 3, None], ids=["list", "int", "none"])
def test_load_refuses_non_object(config, tmp_path):
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_ds_config(config)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_ds_config(path)


# ---------------------------------------------------------------- resolve_global_batch

# (DeepSpeed batch keys, world size) -> (global batch, largest micro-batch), derived by hand from
# train_batch_size = micro * accumulation * world_size
RESOLVED = [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 4, (16, 2)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 1, (16, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4, (32, 2)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4)),
    ({"train_batch_size": 18, "gradient_accumulation_steps": 3}, 3, (18, 2)),
    ({"train_micro_batch_size_per_gpu": 2}, 3, (6, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, (12, 2)),
    ({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1}, 1, (5, 5)),
    ({"train_batch_size": 12}, 3, (12, 4)),
    ({"train_batch_size": 12}, 1, (12, 12)),
    ({"train_batch_size": 7, "gradient_accumulation_steps": 7}, 1, (7, 1)),
]


@pytest.mark.parametrize("keys, ws, expected", RESOLVED, ids=[f"{k}@{w}" for k, w, _ in RESOLVED])
def test_resolve_global_batch(keys, ws, expected):
    assert resolve_global_batch(dict(keys, zero_optimization={"stage": 2}), ws) == expected


CONTRADICTIONS = [
    (
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
        2,
        "train_batch_size 32 != micro batch 2 * gradient_accumulation_steps 4 * world size 2",
    ),
    (
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 3},
        2,
        "train_batch_size 30 != micro batch 3",
    ),
    (
        {"train_batch_size": 30, "gradient_accumulation_steps": 4},
        4,
        "train_batch_size 30 not divisible by gradient_accumulation_steps 4 * world size 4",
    ),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 3}, 1, "not divisible by gradient_accumulation_steps 3"),
    ({"train_batch_size": 10}, 3, "train_batch_size 10 not divisible by world size 3"),
    ({}, 1, "set train_batch_size and train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": 2}, 1, "set train_batch_size and train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 0, "train_micro_batch_size_per_gpu": 2}, 1, "train_batch_size must be a positive integer"),
    (
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": -2},
        1,
        "train_micro_batch_size_per_gpu must be a positive integer",
    ),
    ({"train_batch_size": "16", "train_micro_batch_size_per_gpu": 2}, 1, "train_batch_size must be a positive integer"),
    ({"train_batch_size": 16.0, "train_micro_batch_size_per_gpu": 2}, 1, "train_batch_size must be a positive"),
    ({"train_batch_size": True, "train_micro_batch_size_per_gpu": 1}, 1, "train_batch_size must be a positive"),
    (
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0},
        8,
        "gradient_accumulation_steps must be a positive integer",
    ),
]


@pytest.mark.parametrize("keys, ws, message", CONTRADICTIONS, ids=[f"{k}@{w}" for k, w, _ in CONTRADICTIONS])
def test_resolve_global_batch_refuses(keys, ws, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_global_batch(keys, ws)


@pytest.mark.parametrize(
    "extra, section, message",
    [
        ({}, {}, "a PipelineModule job with ZeRO stage 0: ds_dynatrain changes the layout of pipeline jobs at ZeRO-1"),
        ({"zero_optimization": {"stage": 2}}, {}, "with ZeRO stage 2"),
        (
            {"zero_optimization": {"stage": 1}},
            {"resize_schedule": [{"step": 3, "world_size": 2, "pipeline_parallel": 1, "tensor_parallel": 1}]},
            "resize_schedule step 3: tensor_parallel and pipeline_parallel both given",
        ),
        (
            {"zero_optimization": {"stage": 1}},
            {"recovery": {"peer_replicas": 1}},
            "dynatrain.recovery.peer_replicas: a PipelineModule job has no in-place recovery",
        ),
    ],
    ids=["zero0", "zero2", "schedule_both_degrees", "peer_replicas"],
)
def test_initialize_refuses_what_a_pipeline_job_cannot_have(extra, section, message):
    """What a pipeline job cannot have yet is refused by ``ds_dynatrain.initialize`` before any
    engine or process group exists, naming the key."""
    import torch
    from deepspeed.pipe import PipelineModule

    import ds_dynatrain

    # a PipelineModule needs a process group; the config is what is refused, so an instance is
    # made without running its constructor
    model = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(model)
    model.lin = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "dynatrain": section, **extra}
    with pytest.raises(ConfigError, match=re.escape(message)):
        ds_dynatrain.initialize(model=model, model_parameters=list(model.parameters()), config=config)


@pytest.mark.parametrize(
    "ds_extra, section, world, launched, message",
    [
        ({"autotp_size": 2}, {}, 3, False, "autotp_size 2 with a world size of 3, which it does not divide"),
        (
            {"autotp_size": 2},
            {"resize_schedule": [{"step": 3, "world_size": 2}]},
            4,
            False,
            "(step 3): a shrink to 2 needs `dynatrain launch` (it hosts the membership)",
        ),
        (
            {"autotp_size": 2},
            {"snapshot": {"interval_steps": 5, "dir": "snaps"}},
            2,
            True,
            "dynatrain.snapshot.restore_on_failure (restarting an AutoTP job from its snapshot",
        ),
        ({"autotp_size": 2}, {"recovery": {"peer_replicas": 1}}, 2, False, "dynatrain.recovery.peer_replicas"),
        (
            {"autotp_size": 2},
            {"resize_schedule": [{"step": 3, "world_size": 4, "tensor_parallel": 2}]},
            2,
            False,
            "(step 3): a grow to 4 needs `dynatrain launch` (it hosts the membership)",
        ),
        (
            {"autotp_size": 1},
            {"resize_schedule": [{"step": 3, "world_size": 4, "tensor_parallel": 3}]},
            4,
            False,
            "(step 3): TP degree 3 does not divide the world size 4",
        ),
        (
            None,
            {"resize_schedule": [{"step": 3, "world_size": 2, "tensor_parallel": 1}]},
            2,
            False,
            "gives tensor_parallel, but the job is no AutoTP job",
        ),
        (
            {"autotp_size": 2},
            {"resize_schedule": [{"step": 3, "world_size": 2, "pipeline_parallel": 2}]},
            2,
            False,
            "(step 3) gives pipeline_parallel, but the model is no PipelineModule",
        ),
    ],
)
def test_tensor_parallel_job_refusals(ds_extra, section, world, launched, message):
    """What an AutoTP job cannot have yet is refused before any engine exists, naming the key."""
    from ds_dynatrain.config import DynatrainConfig, check_tensor_parallel

    ds = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    if ds_extra is not None:
        ds["tensor_parallel"] = ds_extra
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_tensor_parallel(ds, DynatrainConfig(**section), world, launched)


def test_tensor_parallel_job_accepted():
    from ds_dynatrain.config import DynatrainConfig, check_tensor_parallel

    ds = {"train_batch_size": 4, "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}
    cfg = DynatrainConfig(resize_schedule=[{"step": 3, "world_size": 4, "tensor_parallel": 1}])
    assert check_tensor_parallel(ds, cfg, 4, launched=False) == 2
    assert check_tensor_parallel({"train_batch_size": 4}, DynatrainConfig(), 4, launched=True) == 1
    # under dynatrain launch: a shrink keeping the TP degree, then a TP switch
    cfg = DynatrainConfig(
        resize_schedule=[{"step": 3, "world_size": 2}, {"step": 5, "world_size": 2, "tensor_parallel": 1}]
    )
    assert check_tensor_parallel(ds, cfg, 4, launched=True) == 2
    # a shrink the TP degree does not divide takes the largest smaller degree, as at run time
    shrink = DynatrainConfig(resize_schedule=[{"step": 3, "world_size": 3}, {"step": 5, "world_size": 1}])
    assert check_tensor_parallel(ds, shrink, 4, launched=True) == 2
    # snapshots: written by any AutoTP job; under launch without the restart after a dead worker
    snaps = {"interval_steps": 2, "dir": "snaps"}
    assert check_tensor_parallel(ds, DynatrainConfig(snapshot=snaps), 4, launched=False) == 2
    no_restart = DynatrainConfig(snapshot={**snaps, "restore_on_failure": False})
    assert check_tensor_parallel(ds, no_restart, 4, launched=True) == 2
    # a grow under dynatrain launch, keeping the TP degree, then one to a degree of its own
    grow = DynatrainConfig(
        resize_schedule=[{"step": 3, "world_size": 6}, {"step": 5, "world_size": 8, "tensor_parallel": 4}]
    )
    assert check_tensor_parallel(ds, grow, 4, launched=True) == 2
    with pytest.raises(ConfigError) as err:
        bad = DynatrainConfig(resize_schedule=[{"step": 3, "world_size": 6, "tensor_parallel": 4}])
        check_tensor_parallel(ds, bad, 4, launched=True)
    assert str(err.value) == (
        "invalid DeepSpeed config: tensor_parallel.autotp_size 2 with dynatrain.resize_schedule (step 3): "
        "TP degree 4 does not divide the world size 6"
    )
