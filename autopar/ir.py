"""GraphIR: the traced model as plain frozen data (the artifact between ``trace`` and ``cost``).

One ``NodeInfo`` per FX node of ``torch.export``'s training IR (high-level aten ops such as
``aten.linear.default``, ``aten.layer_norm.default``, ``aten.scaled_dot_product_attention.default``).
Repeated blocks (the 96 identical layers of GPT-3) are traced once: nodes of the block carry
``block`` (the container's module path, e.g. ``"transformer.h"``) and ``layer_id`` (0 in a planning
trace); ``RepeatedBlock.count`` says how many copies the real model has. Totals on ``GraphIR``
(``param_count``, ``fwd_flops``) are for the *whole* model, repeats included.

Nodes are named by a stable ``key`` that does not depend on how many layers were traced:
``"<module path with layer index replaced by *>|<target>|<k>"``, k counting occurrences of the same
(path, target) inside one layer instance (or the whole graph outside blocks). A Plan refers to
nodes by key, so a plan made on a collapsed trace applies to a full trace of the same model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# the attention op of exported training graphs (``F.scaled_dot_product_attention``): what context
# parallelism's planner, executor and collective prediction look for
SDPA_TARGET = "aten.scaled_dot_product_attention.default"
TARGET_KEY = "|target|0"                   # the loss target's input node (training traces only)
OUTPUT_KEY = "|output|0"                   # the graph's output node (its input: the loss, when traced with one)

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16", "int64"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Ref:
    """An argument that is the output of another node (by key); ``index`` picks from a tuple output."""
    key: str
    index: Optional[int] = None


# Non-tensor arguments are kept as plain literals (ints, floats, bools, str, None, nested tuples).
Arg = Union[Ref, int, float, bool, str, None, tuple]


@dataclass(frozen=True)
class NodeInfo:
    key: str                         # stable id (see module docstring)
    name: str                        # FX node name in the traced graph (for error messages)
    kind: str                        # "input" | "param" | "buffer" | "op" | "output"
    target: str                      # "aten.linear.default", "getitem", ... ("" for input/param/output)
    args: tuple[Arg, ...]            # positional args; tensors as Ref
    kwargs: tuple[tuple[str, Arg], ...]
    outputs: tuple[TensorMeta, ...]  # one entry per tensor output (a split has several)
    flops: int                       # forward FLOPs of this node (0 for views)
    bytes_moved: int                 # forward bytes read + written (roofline numerator)
    module_path: str                 # innermost module, e.g. "transformer.h.0.attn.c_attn"
    block: Optional[str] = None      # repeated-block container path, e.g. "transformer.h"
    layer_id: Optional[int] = None   # index inside the block container
    param_name: Optional[str] = None # fully-qualified name, for kind == "param"/"buffer"
    source: str = ""                 # "file.py:123 in forward" where known

    @property
    def inputs(self) -> tuple[Ref, ...]:
        refs: list[Ref] = []

        def walk(a: Any) -> None:
            if isinstance(a, Ref):
                refs.append(a)
            elif isinstance(a, tuple):
                for x in a:
                    walk(x)

        walk(self.args)
        walk(tuple(v for _, v in self.kwargs))
        return tuple(refs)

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]


@dataclass(frozen=True)
class RepeatedBlock:
    path: str          # container module path, e.g. "transformer.h"
    count: int         # copies in the real model
    traced: int        # copies present in this trace (1 when collapsed)
    param_count: int   # parameters of ONE copy


@dataclass(frozen=True)
class GraphIR:
    nodes: tuple[NodeInfo, ...]            # topological order
    blocks: tuple[RepeatedBlock, ...]
    batch_size: int                        # leading dim of the example inputs
    param_count: int                       # whole model, repeats included
    fwd_flops: int                         # whole model, repeats included
    fingerprint: str                       # sha256 of structure + full-model shapes + block counts
    model_name: str = ""
    graph_module: Any = field(default=None, compare=False, hash=False, repr=False)  # fx.GraphModule (codegen only)
    # torch.export.ExportedProgram the graph came from (graph signature, lifted constants); runtime only.
    exported: Any = field(default=None, compare=False, hash=False, repr=False)

    def node(self, key: str) -> NodeInfo:
        for n in self.nodes:
            if n.key == key:
                return n
        raise KeyError(f"no node with key {key!r} in the traced graph")

    def dependents(self, seeds: set[str]) -> set[str]:
        """Keys of the nodes that depend on ``seeds`` (seeds included)."""
        out = set(seeds)
        for n in self.nodes:                         # topological order
            if any(r.key in out for r in n.inputs):
                out.add(n.key)
        return out

    def batch_free(self, sources: frozenset = frozenset()) -> frozenset[str]:
        """Op nodes computed from parameters, buffers, ``sources`` and each other only (an op
        without tensor inputs, ``arange``, included), and ``sources``: nothing of the batch reaches
        them, so on a data-parallel axis their gradients only ever flow to parameters."""
        kinds = {n.key: n.kind for n in self.nodes}
        out = set(sources)
        for n in self.nodes:                         # topological order
            if n.kind == "op" and all(r.key in out or kinds[r.key] in ("param", "buffer") for r in n.inputs):
                out.add(n.key)
        return frozenset(out)

    def multiplicity(self, n: NodeInfo) -> int:
        """How many times this node runs in the real model (block count / traced copies)."""
        if n.block is None:
            return 1
        b = next(b for b in self.blocks if b.path == n.block)
        return b.count // b.traced
