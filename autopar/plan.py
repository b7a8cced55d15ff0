"""Plan: everything codegen needs, as frozen plain data with a JSON round trip.

The solver is the only producer; codegen/runtime and ``autopar inspect`` are consumers. A Plan is
tied to a model by ``model_fingerprint`` (``GraphIR.fingerprint``) and to a format by
``SCHEMA_VERSION``; loading checks both.

Mesh: ``mesh_axes``/``mesh_shape`` name the logical device mesh *within one pipeline stage*,
outermost axis first, e.g. ``("dp", "tp")`` and ``(16, 8)``; ranks are laid out row-major, so the
last axis is the one whose ranks are adjacent (inside a node). Pipeline stages are outermost:
global rank = stage * prod(mesh_shape) + mesh rank.

Context parallelism (``context_parallel`` = cp > 1, ``context_parallel_mode`` ring or ulysses):
the whole mesh (``Plan.mesh``) has a "cp" axis just inside "dp"; the strategies are placements
on ``mesh_axes``, the mesh the graph's ops run on, whose "dp" axis holds dp x cp ranks: outside
attention a cp rank is a data-parallel rank over its share of the tokens (``codegen/
context_attention.py`` folds each sequence's chunks into the batch), and attention exchanges
K/V (ring) or heads (Ulysses) over the cp ranks.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from autopar.comm_overlap import CommOverlap, overlap_from_dicts
from autopar.mesh import CONTEXT, DATA, PIPELINE, TENSOR, TENSOR_AXES, Mesh, tensor_axes, tensor_axes_problem, tensor_mode
from autopar.mesh import is_int as _is_int
from autopar.placements import Placement, Replicate, format_placements, parse_placements
from autopar.plan_schema import parse_plan_json, schema_message, schema_problems
from autopar.recompute_ops import recompute_problem
from autopar.offload_classes import (OFFLOAD_CHOICES, OFFLOAD_CLASSES, offload_name,  # noqa: F401  (re-exported)
                                     parse_offload)

SCHEMA_VERSION = 1

RECOMPUTE_CHOICES = ("none", "selective", "full")
# Offload, per tensor class (``parse_offload``): what leaves the GPU between its uses.
#   optimizer    this rank's optimizer state, an fp32 master copy of the rows it updates, and the
#                optimizer step itself live on the host (ZeRO-Offload): gradients go down after
#                their reduction, updated parameters come back up
#   grads        (with optimizer) gradients leave the GPU bucket by bucket as each is reduced
#   params       (with optimizer, ZeRO-3) each rank's parameter rows live on the host and are
#                copied up before each use, then gathered as ZeRO-3 does (ZeRO-Infinity)
#   activations  tensors saved for the backward go to the host in the forward and come back in
#                the backward (``saved_tensors_hooks``)
#   nvme         (with optimizer) the optimizer's host state lives in files on NVMe between steps
#                and is streamed through host memory chunk by chunk in the step (ZeRO-Infinity)
# Pipeline schedules, as torch.distributed.pipelining (2.13) names its classes:
#   gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved_1f1b -> ScheduleInterleaved1F1B,
#   interleaved_zb -> ScheduleInterleavedZeroBubble, zbv -> ScheduleZBVZeroBubble,
#   dualpipev -> ScheduleDualPipeV.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")           # one stage per pp rank
V_SCHEDULES = ("zbv", "dualpipev")                   # exactly two stages per rank, "V" layout
# What the runtime executes (``runtime/pipeline.py``): all of them, the zero-bubble ones (their
# backward split into input- and weight-gradient passes) except with ``split_backward_problem``.
EXECUTED_SCHEDULES = PIPELINE_SCHEDULES
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")


def split_backward_problem(schedule: str, recompute: str, tp: int, cp: int, dp: int, zero_stage: int,
                           offload: str = "none") -> Optional[str]:
    """Why the runtime refuses a zero-bubble ``schedule`` with these choices (None: it runs them).
    Its two backward passes each replay a recompute region (``torch.utils.checkpoint`` recomputes
    per autograd call), so the region's collectives (tp / cp edges, ZeRO-3 gathers) would run twice."""
    if schedule not in ZERO_BUBBLE_SCHEDULES or recompute == "none":
        return None
    gathers = zero_stage == 3 and (dp > 1 or "params" in parse_offload(offload))
    if tp > 1 or cp > 1 or gathers:
        what = "tp" if tp > 1 else "cp" if cp > 1 else "ZeRO-3"
        return (f"schedule {schedule} replays recompute regions in both its input- and weight-gradient passes, "
                f"which would repeat their {what} collectives; use --force recompute=none or schedule=1f1b")
    return None
# Context parallelism: how attention crosses the cp ranks ("none": cp == 1)
CONTEXT_MODES = ("ring", "ulysses")

STAGE_AXES = (DATA,) + TENSOR_AXES   # the axes a stage's mesh may name (tensor axes outermost first)

SUMMARY_KEYS = (
    "data_parallel", "tensor_parallel", "pipeline_parallel", "sequence_parallel", "zero_stage",
    "micro_batch_size", "num_micro_batches", "recompute", "offload", "estimated_step_time_s",
    "estimated_tflops_per_gpu", "peak_memory_bytes_per_gpu", "solve_time_s", "pipeline_schedule",
    "virtual_stages", "recompute_layers", "context_parallel", "context_parallel_mode", "tensor_parallel_mode",
)


@dataclass(frozen=True)
class NodeStrategy:
    """The chosen strategy of one node: placements (one per mesh axis) of its output and of each
    tensor input as the node consumes it. A producer/consumer mismatch is a resharding."""
    key: str
    output: tuple[Placement, ...]
    inputs: tuple[tuple[Placement, ...], ...]
    name: str = ""          # family name where one applies: "colwise", "rowwise", "data", "seq", ...

    def __str__(self) -> str:
        ins = ",".join(format_placements(p) for p in self.inputs)
        return f"{self.key}: ({ins}) -> {format_placements(self.output)}"


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank (0..pp-1) that runs global stage ``stage`` under ``schedule``: stage i on
    rank i % pp ("loop", gpipe/1f1b/interleaved), or the "V" of zbv/dualpipev (2 * pp stages:
    rank r runs stages r and 2 * pp - 1 - r), as torch's ``generate_stage_to_rank_mapping``."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, in model order (``Plan.stages[i].index == i``): there are
    ``pp * virtual_stages`` of them and they cover the repeated block's layers contiguously, in
    order, each at least one layer (``[first_layer, last_layer)``; stage 0 starts at layer 0, stage
    i + 1 starts where stage i ends). Stage 0 also runs the nodes before the block (embedding), the
    last stage the nodes after it (head and loss). Cuts may be uneven: the solver balances the
    embedding and head against layers.

    Which pipeline rank runs stage i (``stage_rank``): gpipe, 1f1b (one stage per rank): rank i;
    interleaved_1f1b, interleaved_zb ("loop"): rank i % pp, so rank r runs r, r + pp, r + 2pp, ...;
    zbv, dualpipev ("V", two stages per rank): rank i for i < pp, else 2 * pp - 1 - i, so rank r
    runs stages r and 2 * pp - 1 - r and rank 0 holds both the embedding and the head.

    ``time_per_microbatch_s``: this stage's forward + backward on one micro-batch;
    ``memory_bytes``: the peak bytes of the GPU (pp rank) that runs it (all its stages)."""
    index: int
    first_layer: int        # [first_layer, last_layer) of each repeated block's layers
    last_layer: int
    has_embedding: bool     # nodes before the first block run on this stage
    has_head: bool          # nodes after the last block run on this stage
    time_per_microbatch_s: float
    memory_bytes: int


@dataclass(frozen=True)
class StepTime:
    """Estimated time of one optimizer step, seconds, by category (they add up to ``total_s``)."""
    compute_s: float
    recompute_s: float
    comm_s: tuple[tuple[str, float], ...]   # exposed communication per collective kind
    bubble_s: float
    optimizer_s: float
    total_s: float
    overlap: tuple[CommOverlap, ...] = ()    # per collective: total, hidden, exposed, why (comm_overlap.py)
    host_s: float = 0.0                      # the host's fixed cost of a step (GPUSpec.step_overhead_s)


@dataclass(frozen=True)
class MemoryUse:
    """Peak bytes per GPU by category (the most loaded pipeline stage)."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    other_bytes: int
    total_bytes: int                 # the peak on the GPU: the categories' sum or less (they need not peak at once)
    host_bytes: int = 0              # offloaded to host memory, per GPU (the rank that needs most)
    nvme_bytes: int = 0              # offloaded to NVMe, per GPU

    @property
    def categories_bytes(self) -> int:
        """Each category's peak added: the peak were they all at once (``solver/step_memory.py``)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.other_bytes


@dataclass(frozen=True)
class ClusterRef:
    name: str
    gpu: str
    nodes: int
    gpus_per_node: int
    memory_budget_bytes: int
    host_budget_bytes: int = 0       # host memory per GPU offload may use (written with offload only)
    nvme_budget_bytes: int = 0       # NVMe per GPU offload may use


@dataclass(frozen=True)
class Plan:
    model_name: str
    model_fingerprint: str
    cluster: ClusterRef
    dtype: str
    global_batch: int
    seq_len: Optional[int]
    # parallel degrees and choices
    dp: int
    tp: int
    pp: int
    sequence_parallel: bool
    zero_stage: int
    micro_batch_size: int
    num_micro_batches: int
    recompute: str
    offload: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    strategies: tuple[NodeStrategy, ...]
    stages: tuple[Stage, ...]
    # estimates
    step_time: StepTime
    memory: MemoryUse
    model_flops_per_step: float
    solve_time_s: float
    # pipeline schedule (PIPELINE_SCHEDULES) and stages per pp rank; "1f1b", 1 when pp == 1 (no
    # pipeline). Defaults so that plan files written before these fields load unchanged.
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    # recompute "full" on the first ``recompute_layers`` layers of each pipeline rank only (None:
    # on all of them); the solver's "partial" recompute (the fewest layers that fit)
    recompute_layers: Optional[int] = None
    context_parallel: int = 1               # cp ranks per sequence (see the module docstring)
    context_parallel_mode: str = "none"     # "ring" | "ulysses" when cp > 1
    forced: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        problems = plan_problems(self)
        if problems:
            raise ValueError("inconsistent plan: " + "; ".join(problems)
                             + ". Re-plan with `autopar plan ... --json FILE` rather than editing fields by hand")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.context_parallel

    @property
    def mesh(self) -> Mesh:
        """The whole mesh: pipeline stages outermost (when pp > 1), then ``mesh_axes``, with the
        "cp" axis just inside "dp" when cp > 1."""
        axes, shape = ((PIPELINE,), (self.pp,)) if self.pp > 1 else ((), ())
        cp = self.context_parallel
        for a, n in zip(self.mesh_axes, self.mesh_shape):
            if a == DATA and cp > 1:
                axes, shape = axes + (DATA, CONTEXT), shape + (n // cp, cp)
            else:
                axes, shape = axes + (a,), shape + (n,)
        return Mesh(axes, shape, self.cluster.gpus_per_node)

    @property
    def stage_mesh(self) -> Mesh:
        """The mesh the graph's ops run on in one pipeline stage (every stage has the same): cp
        folded into dp (see the module docstring)."""
        return Mesh(tuple(self.mesh_axes), tuple(self.mesh_shape), self.cluster.gpus_per_node)

    def idle_axes(self) -> tuple[str, ...]:
        """Mesh axes of size > 1 on which no node is sharded or partial: every rank of such an
        axis holds and computes the same thing (legal, e.g. a forced tp=2 on a model too small to
        split, but worth showing). A strategy with fewer placements than axes leaves the leading
        axes replicated."""
        used: set[str] = set()
        n = len(self.mesh_axes)
        for s in self.strategies:
            for placements in (s.output, *s.inputs):
                for axis, p in zip(self.mesh_axes[n - len(placements):], placements):
                    if not isinstance(p, Replicate):
                        used.add(axis)
        return tuple(a for a, size in zip(self.mesh_axes, self.mesh_shape) if size > 1 and a not in used)

    def strategy(self, key: str) -> NodeStrategy:
        for s in self.strategies:
            if s.key == key:
                return s
        raise KeyError(f"plan has no strategy for node {key!r}")

    def summary(self) -> dict[str, Any]:
        n = self.world_size
        return {
            "data_parallel": self.dp,
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "sequence_parallel": self.sequence_parallel,
            "zero_stage": self.zero_stage,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "recompute": self.recompute,
            "offload": self.offload,
            "estimated_step_time_s": self.step_time.total_s,
            "estimated_tflops_per_gpu": self.model_flops_per_step / self.step_time.total_s / n / 1e12,
            "peak_memory_bytes_per_gpu": self.memory.total_bytes,
            "solve_time_s": self.solve_time_s,
            "pipeline_schedule": self.pipeline_schedule,
            "virtual_stages": self.virtual_stages,
            "recompute_layers": self.recompute_layers,
            "context_parallel": self.context_parallel,
            "context_parallel_mode": self.context_parallel_mode,
            "tensor_parallel_mode": tensor_mode(self.mesh_axes, self.mesh_shape),   # solver/tensor_axes.py
        }

    def recomputed_layers(self) -> Optional[frozenset[int]]:
        """The repeated block's layers that recompute in full: None when the plan's recompute is
        not "full" per layer (all layers under "full", none otherwise); else the first
        ``recompute_layers`` layers of each pipeline rank (``stage_rank`` of each stage)."""
        if self.recompute != "full" or self.recompute_layers is None:
            return None
        per_rank: dict[int, list[int]] = {}
        for st in self.stages:
            per_rank.setdefault(stage_rank(self.pipeline_schedule, self.pp, st.index), []).extend(
                range(st.first_layer, st.last_layer))
        return frozenset(l for layers in per_rank.values() for l in sorted(layers)[:self.recompute_layers])

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["strategies"] = [
            {"key": s.key, "name": s.name, "output": format_placements(s.output),
             "inputs": [format_placements(p) for p in s.inputs]}
            for s in self.strategies
        ]
        d["step_time"]["comm_s"] = dict(self.step_time.comm_s)
        d["forced"] = dict(self.forced)
        for part, k in (("memory", "host_bytes"), ("memory", "nvme_bytes"), ("cluster", "host_budget_bytes"),
                        ("cluster", "nvme_budget_bytes")):     # written only with offload
            if not d[part][k]:
                del d[part][k]
        d["summary"] = self.summary()
        return d

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """Plan from its JSON dict. Missing, unknown, mistyped or disagreeing fields are a one-line
        ``ValueError`` that names them by their JSON path (never a half-valid Plan): first the
        schema (``plan_schema``: types and ranges), then ``plan_problems`` (how fields relate),
        then the summary against the fields."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan file holds one JSON object, not {_json_kind(d)}; write one with "
                             "`autopar plan ... --json FILE`")
        if "schema_version" not in d:
            raise ValueError("the JSON object has no schema_version, so it is not a plan file; write one with "
                             "`autopar plan ... --json FILE`")
        version = d["schema_version"]
        if version != SCHEMA_VERSION or not _is_int(version):
            raise ValueError(
                f"plan schema_version {json.dumps(version)} is not the supported {SCHEMA_VERSION}; "
                "re-run `autopar plan ... --json FILE` with this autopar version")
        problems = schema_problems(d, SUMMARY_KEYS)
        if problems:
            raise ValueError(schema_message(problems))
        try:
            plan = cls._from_dict(d)
        except (KeyError, TypeError, AttributeError) as e:      # the schema should have said: a bug
            raise ValueError(f"plan file is malformed ({type(e).__name__}: {e}); write it with "
                             "`autopar plan ... --json FILE`") from None
        summary = d.get("summary")
        if isinstance(summary, dict):
            ours = plan.summary()
            wrong = [k for k in SUMMARY_KEYS if k in summary and not _same(summary[k], ours[k])]
            if wrong:
                raise ValueError("inconsistent plan: its summary disagrees with its fields on "
                                 + ", ".join(f"{k} ({summary[k]!r} vs {ours[k]!r})" for k in wrong)
                                 + ". Re-plan with `autopar plan ... --json FILE` rather than editing it")
        return plan

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The dataclasses from a dict that passed ``schema_problems`` (every field well typed)."""
        d = dict(d)
        d.pop("summary", None)
        d["cluster"] = ClusterRef(**d["cluster"])
        d["strategies"] = tuple(
            NodeStrategy(key=s["key"], name=s.get("name", ""), output=parse_placements(s["output"]),
                         inputs=tuple(parse_placements(p) for p in s["inputs"]))
            for s in d["strategies"])
        d["stages"] = tuple(Stage(**s) for s in d["stages"])
        st = dict(d["step_time"])
        st["comm_s"] = tuple(st["comm_s"].items())
        st["overlap"] = overlap_from_dicts(st.get("overlap", ()))       # absent in older plan files
        d["step_time"] = StepTime(**st)
        d["memory"] = MemoryUse(**d["memory"])
        d["forced"] = tuple(d.get("forced", {}).items())
        d["notes"] = tuple(d.get("notes", ()))
        d["mesh_axes"] = tuple(d["mesh_axes"])
        d["mesh_shape"] = tuple(d["mesh_shape"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Plan from JSON text (``parse_plan_json``: a repeated key or NaN is an error too)."""
        try:
            d = parse_plan_json(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the text is not JSON (line {e.lineno} column {e.colno}: {e.msg}); write a plan "
                             "with `autopar plan ... --json FILE`") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Plan from a file written by ``Plan.save`` (``autopar plan ... --json FILE``). Anything
        else -- a directory, binary data, text that is not JSON, JSON that is not a plan, a plan
        with a bad field -- is one ``ValueError`` line that starts with ``path``. A missing file
        is ``FileNotFoundError``."""
        fix = f"write one with `autopar plan ... --json {path}`"
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except IsADirectoryError:
            raise ValueError(f"{path} is a directory; give the plan JSON file written by "
                             "`autopar plan ... --json FILE`") from None
        except FileNotFoundError:
            raise
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            text = raw.decode("utf-8-sig")          # a byte-order mark some editors add is fine
        except UnicodeDecodeError as e:
            at = e.start + (len(raw) - len(e.object))   # the decoder's offset is past a byte-order mark
            raise ValueError(f"{path} is not a plan JSON file (binary data, not UTF-8 text: byte {at} is "
                             f"0x{raw[at]:02x}); {fix}") from None
        try:
            d = parse_plan_json(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a plan JSON file (line {e.lineno} column {e.colno}: {e.msg}); "
                             f"{fix}") from None
        except ValueError as e:                      # a repeated key, NaN
            raise ValueError(f"{path}: {e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _json_kind(v: Any) -> str:
    """The JSON name of a parsed value's type: "an array", "a number", ..."""
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "true/false"
    if v is None:
        return "null"
    return "a number" if isinstance(v, (int, float)) else type(v).__name__


# ---- consistency ------------------------------------------------------------------------------

_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b and type(a) is type(b)


def plan_problems(p: Plan) -> list[str]:
    """Every way the fields of ``p`` disagree with each other or have the wrong type (empty: none).

    Degrees are positive ints; the mesh's axes are among ``STAGE_AXES`` (dp; tensor axes tp3, tp2, tp
    in that order, sizes multiplying to tp), each with its degree as size, and its product is
    dp * tp; micro-batches times their size times dp is the global batch; the cluster has the
    plan's world size; strategy keys are unique and give one or more placements,
    at most one per mesh axis. Pipeline: the schedule is one of PIPELINE_SCHEDULES with a consistent
    ``virtual_stages`` (1 for gpipe/1f1b, >= 2 for the interleaved ones, 2 for zbv/dualpipev);
    pp == 1 means no pipeline: "1f1b" with 1 virtual stage; there are pp * virtual_stages stages,
    indexed in order, covering the layers contiguously from layer 0 with >= 1 layer each, the
    embedding on stage 0 only and the head on the last stage only. (That the last stage ends at
    the model's layer count is checked against the graph when the plan is compiled.)"""
    out: list[str] = []
    ints = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch_size": p.micro_batch_size,
            "num_micro_batches": p.num_micro_batches, "global_batch": p.global_batch,
            "context_parallel": p.context_parallel}
    for name, v in ints.items():
        if not _is_int(v) or v < 1:
            out.append(f"{name}={v!r} is not a positive integer")
    if not _is_int(p.zero_stage) or not 0 <= p.zero_stage <= 3:
        out.append(f"zero_stage={p.zero_stage!r} is not 0, 1, 2 or 3")
    why = recompute_problem(str(p.recompute))     # per-op: "ops:attention+mlp_act" (``recompute_ops.py``)
    if why:
        out.append(why)
    if p.recompute_layers is not None and (p.recompute != "full" or not _is_int(p.recompute_layers)
                                           or p.recompute_layers < 1):
        out.append(f"recompute_layers={p.recompute_layers!r} needs recompute 'full' and a positive integer")
    try:
        classes = parse_offload(p.offload)
        if "params" in classes and _is_int(p.zero_stage) and p.zero_stage != 3:
            out.append(f"offload={p.offload!r} offloads params, which needs zero_stage 3 (got {p.zero_stage})")
    except ValueError as e:
        out.append(str(e))
    if p.dtype not in _DTYPE_NAMES:
        out.append(f"dtype={p.dtype!r} is not one of {', '.join(_DTYPE_NAMES)}")
    if not isinstance(p.sequence_parallel, bool):
        out.append(f"sequence_parallel={p.sequence_parallel!r} is not true/false")
    if p.pipeline_schedule not in PIPELINE_SCHEDULES:
        out.append(f"pipeline_schedule={p.pipeline_schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    if not _is_int(p.virtual_stages) or p.virtual_stages < 1:
        out.append(f"virtual_stages={p.virtual_stages!r} is not a positive integer")
    cp_mode = p.context_parallel_mode
    if not (cp_mode == "none" if p.context_parallel == 1 else cp_mode in CONTEXT_MODES):
        out.append(f"context_parallel={p.context_parallel!r} with context_parallel_mode={cp_mode!r}: cp=1 has "
                   f"mode 'none', cp > 1 one of {', '.join(CONTEXT_MODES)}")
    if out:                                  # the relations below need well-typed degrees
        return out
    if len(p.mesh_axes) != len(p.mesh_shape) or len(set(p.mesh_axes)) != len(p.mesh_axes):
        out.append(f"mesh_axes {list(p.mesh_axes)} and mesh_shape {list(p.mesh_shape)} do not pair up")
    elif not set(p.mesh_axes) <= set(STAGE_AXES):
        out.append(f"mesh_axes {list(p.mesh_axes)} name axes other than {DATA} and {TENSOR} (or the outer tensor "
                   f"axes {', '.join(TENSOR_AXES[:-1])}; the pipeline axis is the pp field, outermost)")
    elif not all(_is_int(n) and n >= 1 for n in p.mesh_shape):
        out.append(f"mesh_shape {list(p.mesh_shape)} has a size that is not a positive integer")
    else:
        cp = p.context_parallel
        for axis, size in zip(p.mesh_axes, p.mesh_shape):
            degree = ints.get(axis)
            if degree is not None and axis == DATA and cp > 1:
                if size != degree * cp:
                    out.append(f"mesh axis {axis}={size} but dp * cp = {degree * cp} (the graph's data axis "
                               "holds the context-parallel ranks too)")
            elif degree is not None and degree != size and (axis != TENSOR or tensor_axes(p.mesh_axes) == (TENSOR,)):
                out.append(f"mesh axis {axis}={size} but {axis}={degree}")
        out += [w for w in (tensor_axes_problem(p.mesh_axes, p.mesh_shape, p.tp),) if w]
        if cp > 1 and DATA not in p.mesh_axes:
            out.append(f"context_parallel={cp} needs a {DATA} axis in mesh_axes (of size dp * cp)")
        if math.prod(p.mesh_shape) != p.dp * p.tp * cp:
            out.append(f"the mesh {list(p.mesh_shape)} holds {math.prod(p.mesh_shape)} ranks per stage, "
                       f"not dp * cp * tp = {p.dp * cp * p.tp}")
    out += _pipeline_problems(p)
    if p.dp * p.micro_batch_size * p.num_micro_batches != p.global_batch:
        out.append(f"dp({p.dp}) * micro_batch_size({p.micro_batch_size}) * num_micro_batches("
                   f"{p.num_micro_batches}) != global_batch({p.global_batch})")
    c = p.cluster
    if not (_is_int(c.nodes) and _is_int(c.gpus_per_node)) or c.nodes * c.gpus_per_node != p.world_size:
        out.append(f"the cluster has {c.nodes} x {c.gpus_per_node} GPUs but dp * cp * tp * pp = {p.world_size}")
    keys = [s.key for s in p.strategies]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        out.append(f"strategies repeat the nodes {dup[:3]}")
    n_axes = len(p.mesh_axes)
    wide = [s.key for s in p.strategies
            if len(s.output) > n_axes or any(len(i) > n_axes for i in s.inputs)]
    if wide:
        out.append(f"strategies with more placements than the {n_axes} mesh axes: {wide[:3]}")
    empty = [s.key for s in p.strategies if not s.output or not all(s.inputs)]
    if empty:
        out.append(f"strategies with an empty placement (\"\") for the output or an input: {empty[:3]}")
    return out


def _pipeline_problems(p: Plan) -> list[str]:
    out: list[str] = []
    sched, v = p.pipeline_schedule, p.virtual_stages
    if p.pp == 1 and (sched != "1f1b" or v != 1):
        out.append(f"pp=1 (no pipeline) but pipeline_schedule={sched!r}, virtual_stages={v}; "
                   "a plan without a pipeline has \"1f1b\" and 1")
    elif sched in SINGLE_STAGE_SCHEDULES and v != 1:
        out.append(f"pipeline_schedule={sched!r} runs one stage per rank, not virtual_stages={v}")
    elif sched in V_SCHEDULES and v != 2:
        out.append(f"pipeline_schedule={sched!r} runs exactly 2 stages per rank, not virtual_stages={v}")
    elif sched.startswith("interleaved") and v < 2:
        out.append(f"pipeline_schedule={sched!r} needs virtual_stages >= 2, not {v}")
    n = p.pp * v
    if len(p.stages) != n or [s.index for s in p.stages] != list(range(len(p.stages))):
        out.append(f"{len(p.stages)} stages listed for pp={p.pp} x virtual_stages={v} = {n}"
                   if v > 1 else f"{len(p.stages)} stages listed for pp={p.pp}")
        return out
    at = 0
    for s in p.stages:
        if not (_is_int(s.first_layer) and _is_int(s.last_layer)) or s.first_layer != at or s.last_layer <= s.first_layer:
            out.append(f"stage {s.index} holds layers [{s.first_layer!r}, {s.last_layer!r}) but the stages must "
                       f"cover the layers contiguously from layer 0 with >= 1 layer each (expected it to start at {at})")
            break
        at = s.last_layer
    emb = [s.index for s in p.stages if s.has_embedding]
    head = [s.index for s in p.stages if s.has_head]
    if emb != [0] or head != [n - 1]:
        out.append(f"the embedding is on stages {emb} and the head on {head}; expected [0] and [{n - 1}]")
    return out
