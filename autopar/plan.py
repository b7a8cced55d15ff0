"""Plan: everything codegen needs, as frozen plain data with a JSON round trip.

The solver is the only producer; codegen/runtime and ``autopar inspect`` are consumers. A Plan is
tied to a model by ``model_fingerprint`` (``GraphIR.fingerprint``) and to a format by
``SCHEMA_VERSION``; loading checks both.

Mesh: ``mesh_axes``/``mesh_shape`` name the logical device mesh *within one pipeline stage*,
outermost axis first, e.g. ``("dp", "tp")`` and ``(16, 8)``; ranks are laid out row-major, so the
last axis is the one whose ranks are adjacent (inside a node). Pipeline stages are outermost:
global rank = stage * prod(mesh_shape) + mesh rank.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from autopar.placements import Placement, format_placements, parse_placements

SCHEMA_VERSION = 1

RECOMPUTE_CHOICES = ("none", "selective", "full")
OFFLOAD_CHOICES = ("none", "optimizer")

SUMMARY_KEYS = (
    "data_parallel", "tensor_parallel", "pipeline_parallel", "sequence_parallel", "zero_stage",
    "micro_batch_size", "num_micro_batches", "recompute", "offload", "estimated_step_time_s",
    "estimated_tflops_per_gpu", "peak_memory_bytes_per_gpu", "solve_time_s",
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


@dataclass(frozen=True)
class Stage:
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


@dataclass(frozen=True)
class MemoryUse:
    """Peak bytes per GPU by category (the most loaded pipeline stage)."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    other_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class ClusterRef:
    name: str
    gpu: str
    nodes: int
    gpus_per_node: int
    memory_budget_bytes: int


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
    forced: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

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
        }

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
        d["summary"] = self.summary()
        return d

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"plan schema version {version!r} is not the supported {SCHEMA_VERSION}; "
                "re-run `autopar plan ... --json FILE` with this autopar version")
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
        d["step_time"] = StepTime(**st)
        d["memory"] = MemoryUse(**d["memory"])
        d["forced"] = tuple(d.get("forced", {}).items())
        d["notes"] = tuple(d.get("notes", ()))
        d["mesh_axes"] = tuple(d["mesh_axes"])
        d["mesh_shape"] = tuple(d["mesh_shape"])
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"plan file has unknown fields {sorted(unknown)}; was it written by another tool?")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path) as f:
                return cls.from_json(f.read())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a plan JSON file ({e}); write one with `autopar plan ... --json {path}`") from e
