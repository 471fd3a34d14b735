"""The records a job writes: one typed record per event (step, resize, join, snapshot, load,
restore), each with one ``to_dict``; the JSON-lines writer; the console lines.

Every field carries its description (Markdown), so the README's table of record fields is
generated from these classes (``python -m ds_dynatrain.cli.readme README.md`` rewrites it; a test
checks it is current). Times are seconds, sizes bytes; the writer adds ``"time"`` (Unix seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Sequence, Type

from ..transition.execute import TransitionStats


def _f(doc: str, default=0, *, key: Optional[str] = None, optional: bool = False):
    """A record field: ``doc`` for the README, ``key`` its name in the dict (when it is not the
    attribute's), ``optional``: left out of the dict while None."""
    return field(default=default, metadata={"doc": doc, "key": key, "optional": optional})


def record_fields(cls) -> List[dataclasses.Field]:
    """The fields of a record class, its own before those it inherits (the order of its dict)."""
    own = set(cls.__dict__.get("__annotations__", {}))
    fields = dataclasses.fields(cls)
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


@dataclass
class Record:
    """A record of the job's metrics file (``"event"`` names its kind)."""

    EVENT: ClassVar[str] = ""

    def to_dict(self) -> dict:
        """The record as written: ``{"event": ..., field: value, ...}`` (dict keys as documented)."""
        out = {"event": self.EVENT}
        for f in record_fields(type(self)):
            value = getattr(self, f.name)
            if f.metadata.get("optional") and value is None:
                continue
            out[f.metadata.get("key") or f.name] = value
        return out


@dataclass
class StepRecord(Record):
    """One optimizer step (rank 0)."""

    EVENT: ClassVar[str] = "step"
    step: int = _f("global step (optimizer steps) just completed")
    world_size: int = _f("data-parallel world size it ran on")
    loss: float = _f("mean loss of the step's micro-batches over every rank", 0.0)
    lr: float = _f("learning rate of the first parameter group", 0.0)
    samples: int = _f("samples the step trained on over every rank (the global batch)")
    step_s: float = _f(
        "seconds of the step on rank 0, from its first forward to the end of its optimizer step (the "
        "step boundary's snapshot save and resizes not included)",
        0.0,
    )
    samples_per_s: float = _f("`samples` / `step_s`", 0.0)
    tokens_per_s: Optional[float] = _f(
        "`samples_per_s` times the tokens of a sample, where the loader knows them (the returned loader: "
        "the second dimension of a batch tensor, or of its `input_ids`)",
        None,
        optional=True,
    )
    threads: Optional[int] = _f(
        "intra-op CPU threads of rank 0 (`torch.get_num_threads()`): its share of its host's CPUs among the "
        "workers there, set again at every resize, unless `OMP_NUM_THREADS` was set",
        None,
        optional=True,
    )

    @classmethod
    def of(
        cls, step: int, world_size: int, loss: float, lr: float, samples: int, step_s: float, tokens: Optional[int]
    ) -> "StepRecord":
        """The record of a step of ``samples`` samples of ``tokens`` tokens each (None: unknown)
        that took ``step_s`` seconds; throughput 0 when the time is not positive."""
        rate = samples / step_s if step_s > 0 else 0.0
        return cls(
            step=step,
            world_size=world_size,
            loss=loss,
            lr=lr,
            samples=samples,
            step_s=step_s,
            samples_per_s=rate,
            tokens_per_s=None if tokens is None else rate * tokens,
        )


@dataclass
class SnapshotRecord(Record):
    """A snapshot's outcome, written once it is known (rank 0): committed, or failed on some rank."""

    EVENT: ClassVar[str] = "snapshot"
    step: int = _f("step of the snapshot")
    tag: str = _f("its tag, the directory under `dir`", "")
    ok: bool = _f(
        "committed: every rank's files written and synced, then published; `false`: failed (nothing of it "
        "kept, `latest` unchanged, `error` says why)",
        True,
    )
    error: Optional[str] = _f("each failed rank and its cause", None, optional=True)
    failed_ranks: Optional[List[int]] = _f("the ranks whose writes failed", None, optional=True)
    save_s: float = _f("seconds `save_checkpoint` took in the training loop (the flush runs on)", 0.0)
    seconds: float = _f("from `save_checkpoint` to the outcome (the flush and every rank's report)", 0.0)
    bytes: int = _f("bytes of the files every rank wrote (the ranks that reported)")
    capture_s: float = _f(
        "slowest rank's seconds from `save_checkpoint` until its state was no longer read: copied into the "
        "host cache or written from its own memory (aligned tensors, `snapshot.write_from_memory`), or "
        "for GPU state copied into pinned host memory (training may change the state from then on)",
        0.0,
    )
    flush_s: float = _f("slowest rank's seconds from then until its files were written and synced", 0.0)
    bytes_per_s: float = _f("`bytes` / (`capture_s` + `flush_s`): the write bandwidth of the whole job", 0.0)
    dir: str = _f("snapshot directory", "")

    @classmethod
    def of(cls, outcome) -> "SnapshotRecord":
        """The record of a :class:`~ds_dynatrain.checkpoint.snapshot_outcome.SnapshotOutcome`."""
        failed = not outcome.ok
        return cls(
            step=-1 if outcome.step is None else outcome.step,
            tag=outcome.tag,
            ok=outcome.ok,
            error=outcome.error if failed else None,
            failed_ranks=list(outcome.failed_ranks) if failed else None,
            save_s=outcome.save_s,
            seconds=outcome.seconds,
            bytes=outcome.bytes,
            capture_s=outcome.capture_s,
            flush_s=outcome.flush_s,
            bytes_per_s=outcome.bytes / (outcome.capture_s + outcome.flush_s)
            if outcome.capture_s + outcome.flush_s > 0
            else 0.0,
            dir=outcome.dir,
        )


@dataclass
class TransferTotals(Record):
    """What a transition's transfers did on this process (resize and join records)."""

    transfer_s: float = _f(
        "seconds the transfers took, first message posted to last done (the moments' in the background)", 0.0
    )
    keep_s: float = _f("seconds of local copies of state kept in place", 0.0)
    transfer_wait_s: float = _f("seconds waited for the background transfer after the rebuild", 0.0)
    peak_extra_bytes: int = _f(
        "rise of the peak resident set above its size before and after (Linux `clear_refs`; 0 where not measurable)"
    )
    peak_staging_bytes: int = _f("largest packing buffers alive at once")
    partitions_held_bytes: int = _f(
        "bytes of the new partitions that were memory written ahead (a prepared resize's hold, a joiner's), "
        "not allocated at the switch"
    )
    messages: int = _f("messages sent and received")
    bytes_sent: int = _f("bytes sent to other processes")
    bytes_received: int = _f("bytes received from other processes")

    def add_transfer(self, stats: TransitionStats, waited_s: float, peak_extra_bytes: int) -> None:
        """Count one completed transfer phase (the moments' background transfer)."""
        self.transfer_s += stats.exchange_seconds
        self.keep_s += stats.keep_seconds
        self.transfer_wait_s = waited_s
        self.peak_extra_bytes = max(self.peak_extra_bytes, peak_extra_bytes)
        self.peak_staging_bytes = max(self.peak_staging_bytes, stats.peak_staging_bytes)
        self.messages += stats.messages
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received


@dataclass
class ResizeRecord(TransferTotals):
    """A resize this process took part in and stays in (rank 0 writes it)."""

    EVENT: ClassVar[str] = "resize"
    step: int = _f("step after which the job resized")
    from_world_size: int = _f("world size before", key="from")
    to_world_size: int = _f("world size after", key="to")
    generation: int = _f("membership generation formed")
    bytes_moved: int = _f("partition state that crossed between processes")
    bytes_kept: int = _f("partition state that stayed in place")
    seconds: float = _f("the whole resize, from the decision to the return of `engine.step()`", 0.0)
    plan_s: float = _f("rank assignment, planning and the header's agreement", 0.0)
    group_s: float = _f("forming the new default process group (waiting for joiners included)", 0.0)
    xfer_group_s: float = _f("waiting for the transition group built in the background", 0.0)
    rebuild_s: float = _f("detaching and rebuilding the DeepSpeed engine in place", 0.0)
    transfer_overlap: str = _f("what the moments' transfer overlapped (`dynatrain.transfer_overlap`)", "")
    group_reused: bool = _f("the new default group was a cached one (no rendezvous)", False)
    request: Optional[int] = _f("index of the `dynatrain resize` request served", None, optional=True)
    prepare_s: Optional[float] = _f(
        "from the request to the switch, for a request prepared in the background", None, optional=True
    )
    background_build_s: Optional[float] = _f(
        "construction of the new world that ran behind training", None, optional=True
    )
    hidden_fraction: Optional[float] = _f("share of that construction hidden behind training", None, optional=True)
    tensor_parallel_from: Optional[int] = _f(
        "AutoTP degree before (an AutoTP job; `from`/`to` are then world sizes, TP x DP)", None, optional=True
    )
    tensor_parallel_to: Optional[int] = _f("AutoTP degree after", None, optional=True)
    pipeline_parallel_from: Optional[int] = _f(
        "pipeline degree before (a PipelineModule job; `from`/`to` are then world sizes, PP x DP)", None, optional=True
    )
    pipeline_parallel_to: Optional[int] = _f("pipeline degree after", None, optional=True)
    params_bytes: Optional[int] = _f(
        "a grow: working parameters the joiners received from the survivors in all (each joiner every one), "
        "sent beside the moments' transfer",
        None,
        optional=True,
    )
    params_s: Optional[float] = _f(
        "seconds from the start of the moments' transfer to the end of this process's share of the parameters",
        None,
        optional=True,
    )
    prepared_bytes: Optional[int] = _f(
        "memory touched ahead in the background, for the new partitions or freed at the switch for the new engine "
        "(`dynatrain.warm_switch_steps`, `engine.prepare_resize`)",
        None,
        optional=True,
    )
    prepared_touch_s: Optional[float] = _f(
        "seconds the background thread took to touch that memory, beside training", None, optional=True
    )


@dataclass
class JoinRecord(TransferTotals):
    """A process joined the job at a resize (a new process, or a standby one taken back)."""

    EVENT: ClassVar[str] = "join"
    step: int = _f("the job's step when it joined")
    generation: int = _f("generation it joined")
    group_reused: bool = _f("its new default group was a cached one", False)
    seconds: float = _f("from being named in the generation to an engine ready to train", 0.0)
    warmup_s: Optional[float] = _f(
        "forward, backward and an optimizer step on a synthetic batch before it joined; absent: it joined cold",
        None,
        optional=True,
    )


@dataclass
class LoadRecord(Record):
    """A checkpoint loaded at another world size, ZeRO stage, TP or PP degree (rank 0)."""

    EVENT: ClassVar[str] = "load"
    step: int = _f("step of the checkpoint")
    from_world_size: int = _f("saving world size", key="from")
    to_world_size: int = _f("world size it was loaded on", key="to")
    saved_stage: int = _f("ZeRO stage it was saved at")
    stage: int = _f("ZeRO stage it was loaded at")
    bytes_read: int = _f("partition bytes rank 0 read")
    seconds: float = _f("the whole load on rank 0", 0.0)
    plan_s: float = _f("planning the reads", 0.0)
    read_s: float = _f("reading the fragments", 0.0)
    dir: str = _f("the model-state file loaded", "")
    tensor_parallel_from: Optional[int] = _f(
        "AutoTP degree it was saved at (a load across TP; `from`/`to` are then DP sizes)", None, optional=True
    )
    tensor_parallel_to: Optional[int] = _f("AutoTP degree it was loaded at", None, optional=True)
    pipeline_parallel_from: Optional[int] = _f(
        "pipeline degree it was saved at (a load across PP; `from`/`to` are then DP sizes)", None, optional=True
    )
    pipeline_parallel_to: Optional[int] = _f("pipeline degree it was loaded at", None, optional=True)


@dataclass
class RestoreRecord(Record):
    """A job restarted after a worker died, restored from its latest snapshot (rank 0)."""

    EVENT: ClassVar[str] = "restore"
    step: int = _f("step the job goes on after")
    world_size: int = _f("world size of the restarted job (its DP size in an AutoTP or pipeline job)")
    lost_steps: int = _f("steps completed after that snapshot, lost")
    last_step: int = _f("last step the failed job completed")
    dir: str = _f("snapshot directory restored", "")
    skipped: Sequence[str] = _f("tags of newer snapshots found damaged and skipped (empty: none)", ())
    pipeline_parallel: Optional[int] = _f(
        "a PipelineModule job's PP degree after the restart (processes: PP x `world_size`)", None, optional=True
    )


@dataclass
class RecoveryRecord(Record):
    """Workers died and the survivors recovered in place from their copies and the peer replicas
    (rank 0 of the new world)."""

    EVENT: ClassVar[str] = "recovery"
    dead: Sequence[str] = _f("member ids of the workers that died", ())
    step: int = _f("step the job went back to (the newest step of the copies and replicas)")
    failed_step: int = _f("steps this rank had completed when the failure reached it")
    steps_lost: int = _f("completed steps redone: `failed_step - step`")
    from_world_size: int = _f("world size before", key="from")
    to_world_size: int = _f("world size after", key="to")
    generation: int = _f("membership generation formed")
    seconds: float = _f("from the failed collective to an engine ready to train", 0.0)
    detect_s: float = _f("from the failed collective to every member's offer or death (`release_s` included)", 0.0)
    release_s: float = _f("letting go of the failed generation's engine and process groups", 0.0)
    plan_s: float = _f("the recovery step, the new members and the plan", 0.0)
    group_s: float = _f("forming the transfer group and the new default group", 0.0)
    transfer_s: float = _f("moving the partitions out of the copies and replicas", 0.0)
    rebuild_s: float = _f("rebuilding the DeepSpeed engine and installing the state", 0.0)
    bytes_received: int = _f("partition state this rank received")
    served_by: Dict[str, str] = _f("dead member -> the survivor whose replica served it", None)


RECORDS: List[Type[Record]] = [
    StepRecord,
    ResizeRecord,
    JoinRecord,
    SnapshotRecord,
    LoadRecord,
    RestoreRecord,
    RecoveryRecord,
]


class MetricsWriter:
    """Appends records to a JSON-lines file (flushed per record). ``path`` None: nothing written."""

    def __init__(self, path: Optional[str]):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: Record) -> None:
        """Append ``record.to_dict()`` with ``"time"`` (Unix seconds)."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({**record.to_dict(), "time": time.time()}) + "\n")


def format_step(r: StepRecord, steps: int = 1, seconds: Optional[float] = None, samples: Optional[int] = None) -> str:
    """The console line of a step: its loss and learning rate, and the step time and throughput
    averaged over the last ``steps`` steps (``seconds`` and ``samples`` their sums; default: this
    step's own)."""
    seconds = r.step_s if seconds is None else seconds
    samples = r.samples if samples is None else samples
    rate = samples / seconds if seconds > 0 else 0.0
    line = (
        f"step {r.step:5d} | world {r.world_size} | loss {r.loss:.4f} | lr {r.lr:.3e} | "
        f"{seconds / max(steps, 1):.3f} s/step | {rate:,.1f} samples/s"
    )
    if r.tokens_per_s is not None and r.samples_per_s > 0:
        line += f" | {rate * r.tokens_per_s / r.samples_per_s:,.0f} tokens/s"
    return line


def format_resize(r: ResizeRecord) -> str:
    """The console line of a resize."""
    sizes = f"{r.from_world_size} \u2192 {r.to_world_size}"
    if r.tensor_parallel_from is not None:
        a, b = r.tensor_parallel_from, r.tensor_parallel_to
        sizes = f"TP {a} x DP {r.from_world_size // a} \u2192 TP {b} x DP {r.to_world_size // b}"
    if r.pipeline_parallel_from is not None:
        a, b = r.pipeline_parallel_from, r.pipeline_parallel_to
        sizes = f"PP {a} x DP {r.from_world_size // a} \u2192 PP {b} x DP {r.to_world_size // b}"
    return (
        f"resize {sizes} after step {r.step}: "
        f"{r.bytes_moved / 2**20:.2f} MiB moved, {r.bytes_kept / 2**20:.2f} MiB kept in place, "
        f"{r.seconds:.2f} s (plan {r.plan_s:.3f} s, group {r.group_s:.2f} s, transfer {r.transfer_s:.3f} s, "
        f"rebuild {r.rebuild_s:.2f} s)"
    )
