"""A joiner's warm-up (ds_dynatrain/engine/warmup.py): the description of rank 0's forward inputs,
the synthetic batch built from it, a warm-up that leaves no trace in the model or the RNG streams
(oracle: a cold copy of the same model, whose next forward and backward must match bitwise), and
the joiner's wait on a real TCPStore for the description or the generation's go."""

from __future__ import annotations

import copy
import json
import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist
from transformers import LlamaConfig, LlamaForCausalLM

from ds_dynatrain.config import DynatrainConfig
from ds_dynatrain.elastic.keys import BATCH_KEY, GO_KEY
from ds_dynatrain.engine.warmup import (
    describe_inputs,
    engine_bytes,
    hold_engine_memory,
    imported_modules,
    loss_of,
    synthetic_inputs,
    warm_joiner,
    warm_up,
)
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout


def tiny_llama(dropout: float = 0.1) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attention_dropout=dropout,
    )
    return LlamaForCausalLM(cfg)


def test_description_round_trips_through_json_and_builds_zeros_of_its_shapes():
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    desc = describe_inputs((ids,), {"attention_mask": mask, "labels": ids, "use_cache": False, "scale": 0.5})
    assert desc == json.loads(json.dumps(desc))
    args, kwargs = synthetic_inputs(json.loads(json.dumps(desc)), torch.device("cpu"))
    assert len(args) == 1 and args[0].shape == (2, 8) and args[0].dtype == torch.int64
    assert not args[0].any()
    assert kwargs["attention_mask"].dtype == torch.bool and kwargs["attention_mask"].shape == (2, 8)
    assert kwargs["labels"].shape == (2, 8) and kwargs["use_cache"] is False and kwargs["scale"] == 0.5


@pytest.mark.parametrize("bad", [{"input_ids": torch.zeros(1)}, [torch.zeros(1)], object()])
def test_no_description_for_inputs_a_synthetic_batch_cannot_stand_for(bad):
    assert describe_inputs((bad,), {}) is None
    assert describe_inputs((), {"x": bad}) is None


def test_loss_of_finds_the_scalar_to_start_a_backward_from():
    w = torch.ones(3, requires_grad=True)
    assert torch.equal(loss_of(w * 2), torch.tensor(6.0))
    assert loss_of(torch.ones(3)) is None  # no graph behind it
    assert torch.equal(loss_of((torch.arange(3), w * 3)), torch.tensor(9.0))
    assert torch.equal(loss_of({"logits": w * 1}), torch.tensor(3.0))
    out = tiny_llama()(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))
    assert loss_of(out) is not None and torch.equal(loss_of(out), out.loss.float())


def test_warm_up_leaves_parameters_gradients_and_rng_as_a_cold_model_has_them():
    warm, cold = tiny_llama(), tiny_llama()
    warm.train()
    cold.train()
    ids = torch.randint(0, 64, (2, 8))
    desc = describe_inputs((), {"input_ids": ids, "labels": ids})
    rng = torch.get_rng_state()
    seconds = warm_up(warm, desc)
    assert seconds > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in warm.parameters())
    for (n, a), (_, b) in zip(warm.named_parameters(), cold.named_parameters()):
        assert torch.equal(a, b), n
    assert warm.training
    # the next real step: same dropout draws, same loss and gradients, bitwise
    torch.manual_seed(7)
    lw = warm(input_ids=ids, labels=ids).loss
    lw.backward()
    torch.manual_seed(7)
    lc = cold(input_ids=ids, labels=ids).loss
    lc.backward()
    assert torch.equal(lw, lc)
    for (n, a), (_, b) in zip(warm.named_parameters(), cold.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_warm_up_raises_what_the_model_raises_on_the_synthetic_batch():
    model = torch.nn.Embedding(4, 2)  # a zero id fits; a float input does not
    with pytest.raises(RuntimeError):
        warm_up(model, describe_inputs((torch.zeros(2),), {}))
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture
def store():
    st = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    yield st


def test_joiner_warms_up_once_the_inputs_are_described(store):
    ids = torch.zeros(1, 8, dtype=torch.long)
    store.set(BATCH_KEY, json.dumps(describe_inputs((), {"input_ids": ids, "labels": ids})))
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    seconds = warm_joiner(store, model, 3, timeout_s=10)
    assert seconds is not None and seconds > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_joiner_holds_the_memory_its_warm_up_needed_touched(store):
    """The memory the warm-up needed on top of the process (the rise of its peak resident set) is
    handed back allocated and resident: about the weight's gradient at least, which the backward
    allocated anew (64 MiB: above the largest mmap threshold of glibc, 32 MiB, so it came from
    the kernel whatever the process allocated and freed before)."""
    store.set(BATCH_KEY, json.dumps(describe_inputs((torch.zeros(1, 4096),), {})))
    model = torch.nn.Linear(4096, 4096, bias=False)
    hold: list = []
    assert warm_joiner(store, model, 3, timeout_s=10, hold=hold) is not None
    if not os.access("/proc/self/clear_refs", os.W_OK):
        assert hold == []  # unmeasurable: nothing held
        return
    (held,) = hold
    grad_bytes = model.weight.numel() * model.weight.element_size()
    # pages the process held already and had freed (its heap) may serve a little of the rest
    assert held.dtype == torch.uint8 and held.numel() >= grad_bytes - (1 << 20)
    assert int(held[::4096].sum()) == 0  # written: every page was touched


def test_engine_bytes_are_the_new_partitions_and_the_flat_working_copy():
    groups = ((ParamMeta("fc.weight", (10, 10), "bfloat16"), ParamMeta("fc.bias", (10,), "bfloat16")),)
    # ZeRO-2 at 2 ranks: 110 elements padded to 112, 56 a rank, fp32 master + two moments; and
    # DeepSpeed's flat bf16 copy of all 110 working parameters
    assert engine_bytes(ZeroLayout(1, groups, stage=2), 2) == 56 * 4 * 3 + 110 * 2
    # ZeRO-3: the working parameters are partitioned too; pieces of 50 and 5
    assert engine_bytes(ZeroLayout(1, groups, stage=3), 2) == 55 * 4 * 3


def test_a_joiner_holds_its_engine_memory_touched(store):
    """Beside the warm-up's memory, a DP joiner holds its engine's partitions and flat copy at the
    world size it joins (fp32 working parameters here), written, until the switch frees it; not
    once its generation's go has come (a real TCPStore)."""
    model = torch.nn.Linear(1024, 1024)
    params = list(model.parameters())
    ds_config, membership = {"zero_optimization": {"stage": 2}}, SimpleNamespace(store=store)
    dt = SimpleNamespace(config=DynatrainConfig(), held=[], ds_config=ds_config, membership=membership)
    nbytes = hold_engine_memory(dt, model, [params], 4, 3)
    n = 1024 * 1024 + 1024  # padded to a multiple of 2 x 4 already
    assert nbytes == n // 4 * 4 * 3 + n * 4
    # its partitions as fp32 tensors (a quarter of the padded group each, three kinds), then the rest
    *partitions, rest = dt.held
    assert [(t.numel(), t.dtype) for t in partitions] == [(n // 4, torch.float32)] * 3
    assert rest.dtype == torch.uint8 and rest.numel() == n * 4
    assert all(int(t.count_nonzero()) == 0 for t in dt.held)  # zeros
    off = SimpleNamespace(config=DynatrainConfig(warm_switch_steps=0), held=[], ds_config=ds_config)
    assert hold_engine_memory(off, model, [params], 4, 3) == 0 and off.held == []
    # groups a layout cannot describe (a parameter in two of them) hold nothing and raise nothing
    assert hold_engine_memory(dt, model, [params, params], 4, 3) == 0 and len(dt.held) == 4
    store.set(GO_KEY.format(3), "1")  # the survivors switch: the joiner must not make them wait
    assert hold_engine_memory(dt, model, [params], 4, 3) == 0 and len(dt.held) == 4


def test_joiner_joins_cold_when_the_generation_forms_first(store):
    store.set(GO_KEY.format(3), "1")
    t = time.monotonic()
    assert warm_joiner(store, tiny_llama(), 3, timeout_s=10) is None
    assert time.monotonic() - t < 2


def test_joiner_waits_no_longer_than_its_limit(store):
    t = time.monotonic()
    assert warm_joiner(store, tiny_llama(), 3, timeout_s=0.3) is None
    assert 0.3 <= time.monotonic() - t < 3


def test_a_model_the_synthetic_batch_does_not_fit_joins_cold(store):
    store.set(BATCH_KEY, json.dumps(describe_inputs((torch.zeros(2),), {})))
    model = torch.nn.Embedding(4, 2)
    assert warm_joiner(store, model, 3, timeout_s=10) is None
    assert all(p.grad is None for p in model.parameters())


PRELOAD_CHILD = r"""
import json, sys
from datetime import timedelta
import torch
import torch.distributed as tdist
from ds_dynatrain.elastic.keys import BATCH_KEY, MODULES_KEY
from ds_dynatrain.engine.warmup import describe_inputs, publish_modules, warm_joiner

store = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
publish_modules(store)  # this process's own list, as rank 0 writes it
listed = json.loads(store.get(MODULES_KEY))
wanted = ["json.tool", "pydoc_data.topics", "json.no_such_module"]
before = {name: name in sys.modules for name in wanted}
store.set(MODULES_KEY, json.dumps(wanted))
store.set(BATCH_KEY, json.dumps(describe_inputs((torch.zeros(1, 2),), {})))
seconds = warm_joiner(store, torch.nn.Linear(2, 2), 3, timeout_s=10)
print(json.dumps({
    "listed_torch": "torch" in listed, "listed_main": "__main__" in listed, "sorted": listed == sorted(listed),
    "before": before, "after": {name: name in sys.modules for name in wanted}, "seconds": seconds,
}))
"""


def test_joiner_imports_the_modules_rank_0_listed_of_the_packages_it_uses():
    """In a fresh interpreter (its modules are the subject): the list rank 0 writes names what it
    has imported, sorted, without the script; a joiner imports a listed module of a package it
    has (json.tool), leaves a package it never touched alone (pydoc_data) and skips a module that
    does not import; its warm-up goes on after them."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PRELOAD_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["listed_torch"] and not got["listed_main"] and got["sorted"]
    assert got["before"] == {"json.tool": False, "pydoc_data.topics": False, "json.no_such_module": False}
    assert got["after"] == {"json.tool": True, "pydoc_data.topics": False, "json.no_such_module": False}
    assert got["seconds"] is not None and got["seconds"] > 0


def test_the_module_list_is_read_while_other_threads_import():
    """Rank 0 lists its modules at a step boundary while background threads (snapshot, replica
    and group builders) may import: the list must come from one copy of ``sys.modules``, not an
    iteration a new import breaks ("dictionary changed size during iteration", which stopped a
    worker). A thread adds and removes entries as an import would (the seam: ``sys.modules``)."""
    import sys
    import threading

    stop = threading.Event()
    added = []

    def churn():
        while not stop.is_set():
            if len(added) == 256:  # bounded: take them all back, one at a time
                while added:
                    sys.modules.pop(added.pop(), None)
            name = f"_dynatrain_test_churn_{len(added)}"
            sys.modules[name] = sys  # any module object
            added.append(name)

    interval = sys.getswitchinterval()
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        sys.setswitchinterval(1e-6)  # let the threads interleave inside the listing
        for _ in range(2000):
            names = imported_modules()
            assert "ds_dynatrain" in names and "__main__" not in names
    finally:
        sys.setswitchinterval(interval)  # the test process's own, whatever it was
        stop.set()
        t.join()
        for name in added:
            sys.modules.pop(name, None)
