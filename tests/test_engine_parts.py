"""The engine's pure parts (``ds_dynatrain.engine``): typed records and the README's table of their
fields, the transition header, how a joiner's wait for the header reports failures, the restore's
check for a snapshot, and that the library installs no log handler of its own."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from ds_dynatrain.cli.readme import readme_with_records, records_markdown
from ds_dynatrain.engine.header import TransitionHeader, header_failures
from ds_dynatrain.engine.records import RECORDS, JoinRecord, ResizeRecord, StepRecord, format_step
from ds_dynatrain.engine.restore import check_restorable, restore_candidates
from ds_dynatrain.errors import (
    CheckpointIncompleteError,
    LayoutMismatchError,
    SnapshotNotFoundError,
    TransitionAbortedError,
)
from ds_dynatrain.transition.execute import TransitionStats
from io_engine import TMP_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resize_record_dict_names_the_fields_as_documented():
    rec = ResizeRecord(step=15, from_world_size=2, to_world_size=3, generation=1, bytes_moved=10, bytes_kept=20)
    d = rec.to_dict()
    assert d["event"] == "resize" and d["from"] == 2 and d["to"] == 3 and d["step"] == 15
    assert "from_world_size" not in d and "request" not in d and "hidden_fraction" not in d  # optional, unset
    rec.request, rec.hidden_fraction = 4, 0.99
    assert rec.to_dict()["request"] == 4 and rec.to_dict()["hidden_fraction"] == 0.99
    assert StepRecord.of(1, 2, 0.5, 1e-3, samples=12, step_s=0.5, tokens=None).to_dict() == {
        "event": "step",
        "step": 1,
        "world_size": 2,
        "loss": 0.5,
        "lr": 1e-3,
        "samples": 12,
        "step_s": 0.5,
        "samples_per_s": 24.0,
    }
    assert StepRecord.of(1, 2, 0.5, 1e-3, samples=12, step_s=0.5, tokens=32).to_dict()["tokens_per_s"] == 768.0


def test_step_line_averages_time_and_throughput_over_the_interval():
    rec = StepRecord.of(10, 2, 1.25, 2e-3, samples=12, step_s=0.5, tokens=32)
    assert format_step(rec) == (
        "step    10 | world 2 | loss 1.2500 | lr 2.000e-03 | 0.500 s/step | 24.0 samples/s | 768 tokens/s"
    )
    # ten steps of 12 samples in 4 s: 0.4 s a step, 30 samples/s, 960 tokens/s
    assert format_step(rec, steps=10, seconds=4.0, samples=120).endswith(
        "| 0.400 s/step | 30.0 samples/s | 960 tokens/s"
    )
    assert "tokens/s" not in format_step(StepRecord.of(1, 1, 1.0, 0.0, samples=4, step_s=1.0, tokens=None))


def test_a_background_transfer_adds_to_the_record():
    rec = JoinRecord(step=3, generation=2)
    rec.add_transfer(
        TransitionStats(
            bytes_sent=0,
            bytes_received=400,
            seconds=0.5,
            keep_seconds=0.1,
            exchange_seconds=0.4,
            messages=3,
            peak_staging_bytes=64,
        ),
        waited_s=0.2,
        peak_extra_bytes=1000,
    )
    rec.add_transfer(
        TransitionStats(bytes_received=100, seconds=0.1, exchange_seconds=0.1, messages=1, peak_staging_bytes=32),
        waited_s=0.05,
        peak_extra_bytes=10,
    )
    assert rec.bytes_received == 500 and rec.messages == 4 and rec.peak_staging_bytes == 64
    assert rec.peak_extra_bytes == 1000 and rec.transfer_wait_s == 0.05
    assert rec.transfer_s == pytest.approx(0.5) and rec.keep_s == pytest.approx(0.1)


def test_every_record_field_is_documented_and_the_readme_table_is_current():
    for cls in RECORDS:
        assert cls.EVENT and cls.__doc__
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no description"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert readme_with_records(readme) == readme, (
        "README.md's records table is stale: python -m ds_dynatrain.cli.readme README.md"
    )
    assert "| | `hidden_fraction` |" in records_markdown() and "| | `from` |" in records_markdown()
    # one row per event and field: a docstring over two lines would end its row early
    rows = records_markdown().split("\n")
    assert all(r.startswith("| ") and r.endswith(" |") for r in rows[2:]), [r for r in rows if not r.endswith("|")]
    assert sum(r.startswith("| `") for r in rows[2:]) == len(RECORDS)
    with pytest.raises(ValueError, match="no records block"):
        readme_with_records("# a README without the block")


def test_header_round_trips_and_refuses_a_header_without_a_field():
    h = TransitionHeader(
        digest="d",
        old_layout={},
        old_members=["a"],
        new_members=["a", "b"],
        kinds=["fp32"],
        master_moves=False,
        max_inflight_bytes=1024,
        dtype="float32",
        scalars=[{}],
        counters={"global_steps": 3},
    )
    assert TransitionHeader.from_dict(h.to_dict()) == h
    d = h.to_dict()
    del d["digest"]
    with pytest.raises(TransitionAbortedError, match="header incomplete"):
        TransitionHeader.from_dict(d)


def test_a_joiners_header_wait_passes_our_errors_through_and_names_a_group_failure():
    with pytest.raises(LayoutMismatchError, match="parameter w differs"):  # not relabelled "did not arrive"
        with header_failures(5):
            raise LayoutMismatchError("parameter w differs")
    with pytest.raises(TransitionAbortedError, match="generation 5: the header did not arrive: Connection reset"):
        with header_failures(5):
            raise RuntimeError("Connection reset by peer")
    with pytest.raises(KeyError):
        with header_failures(5):
            raise KeyError("other errors are not ours to relabel")


def test_restore_refuses_a_directory_without_a_snapshot(tmp_path):
    with pytest.raises(SnapshotNotFoundError, match="no snapshot to restore from"):
        check_restorable(str(tmp_path))
    with pytest.raises(CheckpointIncompleteError):  # the family a caller of load_checkpoint catches
        check_restorable(str(tmp_path / "missing"))
    (tmp_path / "latest").write_text("global_step8")
    with pytest.raises(SnapshotNotFoundError, match="has no such directory"):  # latest names nothing here
        check_restorable(str(tmp_path))


def test_restore_tries_latest_then_older_snapshots_newest_first(tmp_path):
    for tag in ("global_step4", "global_step8", "global_step12", "best", f"{TMP_PREFIX}global_step16-x"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "global_step20").mkdir()  # no model-state file: not a snapshot
    (tmp_path / "latest").write_text("global_step8\n")
    assert check_restorable(str(tmp_path)) == ["global_step8", "global_step12", "global_step4", "best"]
    (tmp_path / "latest").write_bytes(b"\xff\xfe")  # garbage: the directories still serve
    tags, problems = restore_candidates(str(tmp_path))
    assert tags == ["global_step12", "global_step8", "global_step4", "best"]
    assert len(problems) == 1 and "not UTF-8" in problems[0]


def test_the_library_installs_no_log_handler():
    code = (
        "import logging, ds_dynatrain, ds_dynatrain.cli, ds_dynatrain.engine.build; "
        "lg = logging.getLogger('ds_dynatrain'); print(len(lg.handlers), lg.propagate)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.stdout.split()[-2:] == ["0", "True"]


def test_log_to_console_prints_the_plugins_lines_once(capsys):
    import ds_dynatrain
    from ds_dynatrain.log import logger

    saved = list(logger.handlers), logger.propagate, logger.level
    for h in saved[0]:  # another test of this process may have made the console handler already
        logger.removeHandler(h)
    try:
        h = ds_dynatrain.log_to_console()
        assert ds_dynatrain.log_to_console() is h and logger.handlers == [h]
        logger.info("resize 2 \u2192 3 after step 15")
        assert capsys.readouterr().out == "[dynatrain] resize 2 \u2192 3 after step 15\n"
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
        for h in saved[0]:
            logger.addHandler(h)
        logger.propagate, logger.level = saved[1], saved[2]


def test_tokens_per_sample_of_a_batch():
    """The loader's batch shapes the records' tokens/s: ``[samples, tokens]`` integer ids, bare or
    as ``input_ids``; anything else (floats, one dimension, other objects) is unknown."""
    import torch

    from ds_dynatrain.data import tokens_per_sample

    assert tokens_per_sample(torch.zeros(4, 128, dtype=torch.long)) == 128
    assert tokens_per_sample({"input_ids": torch.zeros(2, 7, dtype=torch.int32), "labels": None}) == 7
    assert tokens_per_sample(torch.zeros(4, 128)) is None
    assert tokens_per_sample(torch.zeros(4, dtype=torch.long)) is None
    assert tokens_per_sample({"x": torch.zeros(2, 7, dtype=torch.long)}) is None
    assert tokens_per_sample([torch.zeros(2, 7, dtype=torch.long)]) is None


def test_an_error_kept_past_its_thread_holds_none_of_its_frames():
    """``without_frames`` on an error raised from another (``raise ... from``) inside a handler of
    a third: nothing that the raising frames held stays alive once the error is the only thing
    kept (what a background transfer or replica refresh hands to the thread that waits for it);
    the messages and the chain stay."""
    import gc
    import weakref

    from ds_dynatrain.errors import TransitionAbortedError, without_frames

    class Held:  # stands for a process group with unfinished works
        pass

    def fail(held):
        try:
            try:
                raise RuntimeError("timed out waiting for recv")
            except RuntimeError:
                raise ValueError("inner handler failed") from None
        except ValueError as err:
            raise TransitionAbortedError("receive from g0r1 failed") from err

    gc.disable()  # reference counting alone
    try:
        held = Held()
        ref = weakref.ref(held)
        try:
            fail(held)
        except TransitionAbortedError as err:
            kept = without_frames(err)
        del held
        assert ref() is None
        assert str(kept) == "receive from g0r1 failed" and str(kept.__cause__) == "inner handler failed"
        assert kept.__traceback__ is None and kept.__cause__.__traceback__ is None
    finally:
        gc.enable()


def test_a_background_call_hands_its_value_or_its_error_to_the_waiting_thread():
    """:class:`BackgroundCall` (a transfer's or a transition group's build thread): the value;
    a ``TransitionAbortedError`` raised again with its message, another error named under the
    caller's words, each with the call's error as the cause and none of its frames kept; a call
    still running named by ``late()`` within the wait's limit."""
    import gc
    import threading
    import weakref

    from ds_dynatrain.errors import TransitionAbortedError
    from ds_dynatrain.transition.background import BackgroundCall

    call = BackgroundCall(lambda: 41, "test-call", keep=lambda v: v + 1)
    assert call.result(10, lambda: "late", "failed") == 42 and call.done() and call.error is None

    class Held:  # stands for a group with unfinished works, held by the failing frame
        pass

    def fail(held, err):
        raise err

    gc.disable()  # reference counting alone
    try:
        for raised, said in (
            (TransitionAbortedError("receive from g0r1 failed"), "^receive from g0r1 failed$"),
            (RuntimeError("Connection closed by peer"), "^a transfer failed: Connection closed by peer$"),
        ):
            held = Held()
            ref = weakref.ref(held)
            call = BackgroundCall(lambda held=held, raised=raised: fail(held, raised), "test-call")
            del held
            with pytest.raises(TransitionAbortedError, match=said) as info:
                call.result(10, lambda: "late", "a transfer failed")
            assert info.value.__cause__ is call.error and call.error.__traceback__ is None
            del info
            assert ref() is None  # the kept error holds no frame of the thread
    finally:
        gc.enable()

    go = threading.Event()
    call = BackgroundCall(lambda: go.wait(10), "test-call")
    with pytest.raises(TransitionAbortedError, match="^still running after 0.2 s$"):
        call.result(0.2, lambda: "still running after 0.2 s", "failed")
    go.set()
    assert call.result(10, lambda: "late", "failed") is True


def test_a_background_group_given_up_is_shut_down_whenever_its_build_ends():
    """:class:`BackgroundGroup` closed after its build ended shuts the group down at once; closed
    while it is still being built, the build shuts it down when it ends; ``get`` then returns
    nothing; a group taken is not shut down. Real one-rank gloo groups on a ``HashStore``, their
    ``shutdown`` calls recorded (the seam)."""
    import threading
    from datetime import timedelta

    import torch.distributed as tdist

    from ds_dynatrain.elastic.groups import BackgroundGroup

    shut = []

    class Recorded:
        def __init__(self):
            self.pg = tdist.ProcessGroupGloo(tdist.HashStore(), 0, 1, timedelta(seconds=10))

        def shutdown(self):
            shut.append(self)
            self.pg.shutdown()

    def build(go=None):
        if go is not None:
            go.wait(10)
        return Recorded()

    taken = BackgroundGroup(build, "test-group").get(10)
    assert isinstance(taken, Recorded) and shut == []

    built = BackgroundGroup(build, "test-group")
    group = built.get(10)
    built.close()
    assert shut == [group] and built.get(10) is None
    built.close()  # once only
    assert shut == [group]

    go = threading.Event()
    late = BackgroundGroup(lambda: build(go), "test-group")
    late.close()
    assert not late.ready() and shut == [group]
    go.set()
    assert late.get(10) is None and late.error is None
    assert len(shut) == 2 and shut[1] is not group
    taken.pg.shutdown()


def test_a_layout_argument_that_is_no_integer_is_refused_by_name():
    """``resize`` and ``prepare_resize`` (both engines) check their arguments with
    ``require_integers`` before anything else: a string, a float or a bool is refused naming the
    argument and the value (a ``ResizeRefusedError``, which the engines leave the job unchanged
    on), where a comparison inside the switch raised a bare ``TypeError``; None stays allowed for
    a degree."""
    from ds_dynatrain.engine.state import require_integers
    from ds_dynatrain.errors import ResizeRefusedError

    require_integers(2, pipeline_parallel=None, tensor_parallel=1)
    for kwargs, said in (
        (dict(world_size=2, pipeline_parallel="x"), "pipeline_parallel 'x' refused: it must be an integer"),
        (dict(world_size=2.0), "world_size 2.0 refused: it must be an integer"),
        (dict(world_size=None), "world_size None refused: it must be an integer"),
        (dict(world_size=2, tensor_parallel=True), "tensor_parallel True refused: it must be an integer"),
    ):
        with pytest.raises(ResizeRefusedError, match=re.escape(said)):
            require_integers(**kwargs)
