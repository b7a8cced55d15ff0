"""Emitted code: one ``torch.fx.GraphModule`` per pipeline stage, the plan's placements explicit.

    gm = emit_stage(graph, program, cut=cut, stage=k)   # graph: the FULL trace the program is for
    print(gm.code)                                      # `autopar inspect plan.json --code`
    bind(gm, mesh=stage_mesh, params=store, buffers=buffers, constants=constants_of(graph))
    loss = gm(input_ids, target)                        # DTensors (or full tensors) on the mesh

The module's ``forward`` takes the stage's inputs (stage 0: the model inputs; later stages: the
values the stage before sends, in ``StageCut.recv`` order; the last stage also the target) and
returns what the stage sends (``StageCut.send``, in the wire placements) or, on the last stage of
a training graph, the loss. Each parameter enters through ``param(rt, name)`` (``rt = self.rt``,
set by ``bind``: ``params.use(name)``, the ParamStore's autograd-correct DTensor); each op node is
the same aten call on DTensors. Placements are strings, one entry per stage-mesh axis in its order
(``S(0)R``; ``_`` = keep what the value has). On every edge where the consumer's planned input
placement differs from the producer's planned output: ``redistribute(x, 'RR')`` (``edges.edge``:
DTensor's redistribute, backward to the producer's placement, the solver's cost model); where
they agree but the input is Replicate on an axis of size > 1: ``replicated_input(x, 'RR')``
(forward the identity, backward all-reduces a Partial gradient: Megatron's "f"). Inputs, buffers
and factory outputs enter with ``place(rt, x, 'S(0)R')`` (a full tensor every rank holds -> its
shard, no communication). Ops the executor treats specially are calls of named functions that run
the executor's code: ``vocab_parallel_cross_entropy`` (``vocab_ce.py``), ``strided_split`` (fused
QKV), ``local_op`` (ops without a DTensor rule: attention on CPU, split convolutions, ``fallbacks``),
``assert_global_metadata``; a recompute region is a submodule ``self.recompute_<i>`` run by
``recompute(...)`` (``torch.utils.checkpoint``, non-reentrant, early stop off, as the executor).
Its forward equals the executor's for the same plan (``tests/runtime/test_emit.py``); its
backward is autograd's through the same edges.

What runs today is still the interpreter, ``executor.GraphExecutor``, kept because this module
does not yet cover:
- fused kernels (``fused.py``, ``patterns.py``): the emitted ops are the plain aten calls;
- output pins: the executor also moves every op's output to its planned placement when DTensor's
  rule gives another; here the consumer's edge resolves from whatever the op produced (the same
  values; a consumer that "keeps" may then see DTensor's placement instead of the plan's);
- ops without a DTensor rule found only by probing at run time (the executor probes every new
  (op, placements) once): ``local_op`` is emitted for the known ones and for ``fallbacks``;
- in-place buffer writes (BatchNorm statistics, counters): ``NotImplementedError`` naming the node;
- local-dp mode (plain tensors on the local batch): emit from a DTensor program (``local_dp=None``);
- constant causal masks verified on the first step (``causal_check.py``): the mask is computed and
  attention runs masked, as on the executor's first step;
- micro-batch loops, gradient reduction and pipeline schedules stay with the runtime.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autopar.codegen import fallback
from autopar.codegen.edges import edge, resolve_placements
from autopar.codegen.program import RankProgram, axis_index, compile_program
from autopar.codegen.shards import contiguous_stride, local_ranges, slice_of
from autopar.codegen.stages import PipelineCut, wire_placements
from autopar.codegen.vocab_ce import VOCAB_CE_TARGET, VocabParallelCE, ce_arg, vocab_parallel_ce
from autopar.codegen.writes import written_args
from autopar.ir import GraphIR
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Replicate, Shard, parse_placement, to_torch


# ---- placements as text ------------------------------------------------------------------------

def fmt(placements) -> str:
    """``(Shard(0), None)`` -> ``"S(0)_"`` (None: keep)."""
    return "".join("_" if p is None else str(p) for p in placements)


def parse(text: str) -> tuple:
    return tuple(None if t == "_" else parse_placement(t) for t in re.findall(r"S\(\d+\)|R|P|_", text))


def _norm(placements, ndim: int):
    """Negative Shard dims made absolute (for comparison and printing)."""
    if placements is None:
        return None
    return tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)


# ---- the functions the emitted code calls ------------------------------------------------------

class StageRuntime:
    """What ``param``/``buffer``/``place`` read: the stage's DeviceMesh, ``params.use(name)`` (a
    ``runtime.params.ParamStore`` or anything with that method), full buffers and constants."""

    def __init__(self, mesh, params, buffers: Optional[dict] = None, constants: Optional[dict] = None) -> None:
        self.mesh, self.params = mesh, params
        self.buffers, self.constants = buffers or {}, constants or {}
        self.keep = tuple(i for i in (axis_index_of(mesh, DATA),) if i is not None)


def axis_index_of(mesh, role: str) -> Optional[int]:
    names = tuple(mesh.mesh_dim_names or ())
    return names.index(role) if role in names else None


def param(rt: StageRuntime, name: str):
    """Parameter ``name`` as a DTensor in its storage placement (one use per scope)."""
    return rt.params.use(name)


def place(rt: StageRuntime, x, placements: str):
    """A full tensor every rank holds -> this rank's shard in ``placements`` (no communication;
    Partial reads as Replicate); a DTensor -> ``redistribute``."""
    if isinstance(x, DTensor):
        return redistribute(x, placements)
    want = tuple(Replicate() if p is None or isinstance(p, Partial) else p for p in _norm(parse(placements), x.dim()))
    local = slice_of(x, local_ranges(x.shape, want, tuple(rt.mesh.shape), tuple(rt.mesh.get_coordinate()))) \
        if x.dim() else x
    return DTensor.from_local(local.contiguous(), rt.mesh, tuple(to_torch(p) for p in want), run_check=False,
                              shape=x.shape, stride=contiguous_stride(x.shape))


def buffer(rt: StageRuntime, name: str, placements: str):
    """Buffer (or lifted constant) ``name``, placed."""
    return place(rt, rt.buffers[name] if name in rt.buffers else rt.constants[name], placements)


def redistribute(x, placements: str, keep_partial_grad: Optional[str] = None):
    """``x`` in ``placements`` (``edges.edge``: autograd-correct). ``keep_partial_grad``: the axis
    on which a parameter's gradient stays Partial (the reducer sums it)."""
    if not isinstance(x, DTensor):
        return x
    keep = (axis_index_of(x.device_mesh, keep_partial_grad),) if keep_partial_grad else ()
    return edge(x, resolve_placements(tuple(x.placements), x.ndim, parse(placements)), keep)


def replicated_input(x, placements: str, keep_partial_grad: Optional[str] = None):
    """``x`` already in ``placements``: identity forward; backward all-reduces a Partial gradient."""
    return redistribute(x, placements, keep_partial_grad)


def strided_split(x: DTensor, k: int) -> tuple:
    """A strided tensor-parallel shard (fused QKV) split into its k chunks on local tensors."""
    t = axis_index_of(x.device_mesh, TENSOR)
    dim = x.placements[t].dim
    shape = list(x.shape)
    shape[dim] //= k
    return tuple(DTensor.from_local(c, x.device_mesh, x.placements, run_check=False, shape=torch.Size(shape),
                                    stride=contiguous_stride(shape)) for c in torch.chunk(x.to_local(), k, dim=dim))


def vocab_parallel_cross_entropy(*args, **kwargs):
    """``aten.cross_entropy_loss`` on class-sharded logits via ``loss_parallel`` (``vocab_ce.py``);
    otherwise the aten op on DTensors."""
    if vocab_parallel_ce(args, kwargs, args[0].device_mesh):
        return VocabParallelCE.apply(args[0], args[1], ce_arg(args, kwargs, 3, "reduction", 1),
                                     ce_arg(args, kwargs, 4, "ignore_index", -100))
    return torch.ops.aten.cross_entropy_loss.default(*args, **kwargs)


def local_op(op, *args, **kwargs):
    """``op`` on local shards where DTensor has no (right) rule (attention on the CPU, a
    convolution with split operands), else the op on DTensors; as the executor decides."""
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not flat:
        return op(*args, **kwargs)
    target = str(op)
    if not ((target in fallback.SDPA_TARGETS and flat[0].device.type == "cpu")
            or fallback.needs_local(target, [t.placements for t in flat])):
        return op(*args, **kwargs)
    return fallback.run_local(op, target, args, kwargs, flat[0].device_mesh)


def forced_local_op(op, *args, **kwargs):
    """``op`` on local shards, always (a target in ``emit_stage(fallbacks=...)``: one the executor
    found DTensor has no rule for)."""
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not flat:
        return op(*args, **kwargs)
    return fallback.run_local(op, str(op), args, kwargs, flat[0].device_mesh)


def recompute(region: nn.Module, rt: StageRuntime, *values):
    """A recompute region: ``torch.utils.checkpoint`` (non-reentrant, early stop off)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(region, rt, *values, use_reentrant=False)


def _register_names() -> None:
    """Print the helpers under their own names (``redistribute(...)``, not a module path)."""
    from torch.fx.graph import _register_custom_builtin

    for fn in (param, place, buffer, redistribute, replicated_input, strided_split,
               vocab_parallel_cross_entropy, local_op, forced_local_op, recompute, fallback.assert_global_metadata):
        _register_custom_builtin(fn.__name__, f"from {fn.__module__} import {fn.__name__}", fn)


_register_names()


# ---- emission ----------------------------------------------------------------------------------

def _tensor_meta(n: fx.Node):
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


class _Emitter:
    def __init__(self, gm: fx.GraphModule, program: RankProgram, fallbacks: frozenset) -> None:
        self.gm, self.program = gm, program
        self.plans = {n.name: n for n in program.nodes}
        self.axes = tuple(program.mesh.axes)
        self.sizes = tuple(program.mesh.shape)
        self.data, self.tensor = axis_index(program.mesh, DATA), axis_index(program.mesh, TENSOR)
        self.fallbacks = fallbacks
        self.root = nn.Module()
        self.root.rt = None
        self.param_tp = {p.name: p.tp for p in program.params}

    def have(self, n: fx.Node, ndim: int):
        """The placements node ``n``'s value has in the emitted code (None: not known statically)."""
        p = self.plans.get(n.name)
        if p is None:
            return None
        if p.kind == "param":
            return tuple(self.param_tp.get(p.param_name, Replicate()) if i == self.tensor else Replicate()
                         for i in range(len(self.axes)))
        if p.output is None or any(x is None for x in p.output):
            return None
        return _norm(p.output, ndim)

    def emit(self, members: list, g: fx.Graph, env: dict, rt: fx.Node, inside: bool = False) -> None:
        """Emit ``members`` (original nodes, graph order) into ``g``; ``env``: original name -> node."""
        params: dict[str, fx.Node] = {}
        regions = {} if inside else {p.name: p.region for p in self.program.nodes if p.region is not None}
        done: set[int] = set()
        for node in members:
            r = regions.get(node.name)
            if r is not None:
                if r not in done:
                    done.add(r)
                    self.region(self.program.regions[r], members, g, env, rt)
                continue
            self.node(node, g, env, rt, params)

    def region(self, region, members, g: fx.Graph, env: dict, rt: fx.Node) -> None:
        names = set(region.nodes)
        inner = [n for n in members if n.name in names]
        reads = list(dict.fromkeys(a.name for n in inner for a in n.all_input_nodes
                                   if a.name not in names and self.plans[a.name].kind != "param"))
        used_after = [n.name for n in inner if any(u.name not in names for u in n.users)]
        sub = fx.Graph()
        sub_env = {"rt": sub.placeholder("rt")}
        sub_env.update({name: sub.placeholder(name) for name in reads})
        inner_env = {k: sub_env[k] for k in reads}
        self.emit(inner, sub, inner_env, sub_env["rt"], inside=True)
        sub.output(tuple(inner_env[n] for n in used_after))
        attr = f"recompute_{region.index}"
        setattr(self.root, attr, fx.GraphModule(nn.Module(), sub, class_name=f"Recompute{region.index}"))
        call = g.call_function(recompute, (g.get_attr(attr), rt, *[env[n] for n in reads]))
        for i, name in enumerate(used_after):
            env[name] = g.call_function(operator.getitem, (call, i), name=name)

    def node(self, node: fx.Node, g: fx.Graph, env: dict, rt: fx.Node, params: dict) -> None:
        p = self.plans[node.name]
        if node.op == "placeholder":
            if p.kind == "buffer":
                name = p.param_name or node.name
                env[node.name] = g.call_function(buffer, (rt, name, fmt(self.placed(p, node))), name=node.name)
            return                           # inputs: made by the caller; parameters: on first use
        if node.op != "call_function":
            raise NotImplementedError(f"{node.format_node()}: node op {node.op!r} is not emitted")
        if written_args(node):
            raise NotImplementedError(f"node {p.key} ({node.name}): an in-place write ({p.target}) is not "
                                      "emitted yet; the executor writes it back into the buffer")
        counter = [0]

        def arg(a: fx.Node):
            i = counter[0]
            counter[0] += 1
            ap = self.plans[a.name]
            if ap.kind == "param":
                if ap.param_name not in params:
                    params[ap.param_name] = g.call_function(param, (rt, ap.param_name),
                                                            name=_ident(ap.param_name))
                v = params[ap.param_name]
            else:
                v = env[a.name]
            meta = _tensor_meta(a)
            if meta is None or not p.inputs or i >= len(p.inputs) or p.inputs[i] is None:
                return v
            want = _norm(p.inputs[i], meta.dim())
            have = self.have(a, meta.dim())
            keep_axis = self.data if ap.kind == "param" else None
            kw = {"keep_partial_grad": self.axes[keep_axis]} if keep_axis is not None else {}
            resolved = tuple(h if w is None or (isinstance(w, Partial) and isinstance(h, Partial)) else w
                             for h, w in zip(have, want)) if have is not None else None
            if resolved is None or resolved != have:
                return g.call_function(redistribute, (v, fmt(want)), kw)
            grad = meta.is_floating_point() and ap.kind not in ("input", "buffer")
            if grad and any(isinstance(w, Replicate) and n > 1 and j != keep_axis
                            for j, (w, n) in enumerate(zip(resolved, self.sizes))):
                return g.call_function(replicated_input, (v, fmt(want)), kw)
            return v

        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        t = p.target
        if p.strided:
            out = g.call_function(strided_split, (args[0], p.strided), name=node.name)
        elif t == VOCAB_CE_TARGET and self._class_sharded(p, node):
            out = g.call_function(vocab_parallel_cross_entropy, args, kwargs, name=node.name)
        elif t == fallback.ASSERT_METADATA:
            out = g.call_function(fallback.assert_global_metadata, args, kwargs, name=node.name)
        elif t in self.fallbacks:
            out = g.call_function(forced_local_op, (node.target, *args), kwargs, name=node.name)
        elif t in fallback.SDPA_TARGETS or t in fallback.CONV_TARGETS:
            out = g.call_function(local_op, (node.target, *args), kwargs, name=node.name)
        else:
            out = g.call_function(node.target, args, kwargs, name=node.name)
        if _tensor_meta(node) is not None and not any(
                isinstance(v, torch.Tensor) for a in node.all_input_nodes
                for v in torch.utils._pytree.tree_leaves(a.meta.get("val"))):      # a factory
            out = g.call_function(place, (rt, out, fmt(self.placed(p, node))), name=f"{node.name}_placed")
        env[node.name] = out

    def placed(self, p, node: fx.Node) -> tuple:
        meta = _tensor_meta(node)
        want = p.output or (None,) * len(self.axes)
        return _norm(tuple(Replicate() if w is None else w for w in want), meta.dim() if meta is not None else 0)

    def _class_sharded(self, p, node: fx.Node) -> bool:
        if self.tensor is None or self.sizes[self.tensor] == 1 or not p.inputs or p.inputs[0] is None:
            return False
        w = p.inputs[0][self.tensor]
        nd = _tensor_meta(node.args[0]).dim()
        return isinstance(w, Shard) and w.dim % nd == 1


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def emit_stage(graph: GraphIR, program: RankProgram, *, cut: Optional[PipelineCut] = None, stage: int = 0,
               device: Any = "cpu", fallbacks=()) -> fx.GraphModule:
    """The GraphModule of stage ``stage`` (``cut`` None: the whole graph, pp == 1) under
    ``program`` (a DTensor program of the full trace ``graph``); see the module docstring.
    ``fallbacks``: op targets to run on local tensors (``GraphExecutor.fallbacks`` of a run)."""
    from torch.export.graph_signature import OutputKind

    from autopar.trace import graph_on_device

    if program.local_dp:
        raise NotImplementedError("local-dp programs are not emitted; compile the program with local_dp=None")
    gm = graph_on_device(graph, device)
    em = _Emitter(gm, program, frozenset(fallbacks))
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    by_name = {n.name: n for n in gm.graph.nodes}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    if cut is None:
        specs = graph.exported.graph_signature.output_specs
        outs = [a.name for a, s in zip(out_node.args[0], specs) if s.kind == OutputKind.USER_OUTPUT]
        part, recv, target = nodes, [], ""
        inputs = [n.name for n in nodes if em.plans[n.name].kind == "input"]
    else:
        if not 0 <= stage < len(cut.stages):
            raise ValueError(f"stage {stage} is out of range: the plan has {len(cut.stages)} stages (0.."
                             f"{len(cut.stages) - 1})")
        sc = cut.stages[stage]
        last = stage == len(cut.stages) - 1
        names = set(sc.nodes) | (set(cut.loss) if last else set())
        part = [n for n in nodes if n.name in names]
        recv = list(sc.recv)
        target = cut.target if last else ""
        inputs = [x for x in cut.inputs if x in names] + ([target] if target and target in names else [])
        outs = [cut.loss_output] if last and cut.target else list(sc.send)
    g = fx.Graph()
    rt = g.get_attr("rt")
    env: dict[str, fx.Node] = {}
    for name in recv:
        env[name] = g.placeholder(name)
    for name in inputs:
        ph = g.placeholder(name)
        env[name] = g.call_function(place, (rt, ph, fmt(em.placed(em.plans[name], by_name[name]))),
                                    name=f"{name}_placed")
    em.emit([n for n in part if n.name not in env], g, env, rt)
    sends = cut is not None and not (stage == len(cut.stages) - 1 and cut.target)
    results = []
    for name in outs:
        v = env[name]
        if sends:                           # boundary values cross in the wire placements
            wire = wire_placements(em.plans[name].output, len(em.axes))
            v = g.call_function(redistribute, (v, fmt(_norm(wire, _tensor_meta(by_name[name]).dim()))))
        results.append(v)
    g.output(results[0] if len(results) == 1 and not sends else tuple(results))
    g.lint()
    return fx.GraphModule(em.root, g, class_name=f"Stage{stage}")


def constants_of(graph: GraphIR, device: Any = "cpu") -> dict:
    """The lifted constants the graph's buffer placeholders read (name -> tensor)."""
    spec = {s.arg.name: s.target for s in graph.exported.graph_signature.input_specs if hasattr(s.arg, "name")}
    return {n.name: graph.exported.constants[spec[n.name]].to(device)
            for n in graph.nodes if n.kind == "buffer" and n.param_name is None}


def bind(gm: fx.GraphModule, *, mesh, params, buffers: Optional[dict] = None,
         constants: Optional[dict] = None) -> fx.GraphModule:
    """Make ``gm`` runnable on ``mesh`` (the stage's DeviceMesh, axes named as the plan's)."""
    gm.rt = StageRuntime(mesh, params, buffers, constants)
    return gm


def emit_plan(plan, stage: Optional[int] = None) -> list[tuple[str, fx.GraphModule]]:
    """(header, module) per stage of a saved plan (``stage``: only that one): the model rebuilt
    from ``plan.model_name`` on the meta device at one micro-batch, traced in full as the runtime
    does (``autopar inspect plan.json --code``)."""
    from autopar.codegen.stages import cut_pipeline
    from autopar.models import build_model
    from autopar.trace import trace_model

    if plan.context_parallel > 1:
        raise ValueError(f"the generated modules do not cover context parallelism yet (the plan has cp="
                         f"{plan.context_parallel}); `autopar inspect` without --code shows the plan, and the "
                         "runtime runs it")
    n = len(plan.stages) if plan.pp > 1 else 1
    if stage is not None and not 0 <= stage < n:
        raise ValueError(f"--stage {stage} is out of range: the plan has {n} stage{'s' if n > 1 else ''} (0..{n - 1})")
    try:
        b = build_model(plan.model_name, batch=plan.global_batch // plan.num_micro_batches,
                        seq_len=plan.seq_len, device="meta")
    except Exception as e:                  # a user file that moved, a spec this version lacks
        raise ValueError(f"cannot rebuild the plan's model {plan.model_name!r} to emit its code: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        collapse_repeats=False, model_name=b.name)
    program = compile_program(graph, plan)
    cut = cut_pipeline(graph, plan) if plan.pp > 1 else None
    mesh = plan.stage_mesh.describe()
    out = []
    for k in range(n) if stage is None else (stage,):
        st = plan.stages[k] if k < len(plan.stages) else None
        layers = f"layers {st.first_layer}..{st.last_layer - 1}" if st is not None else "all layers"
        out.append((f"stage {k}: {layers}, mesh {mesh}", emit_stage(graph, program, cut=cut, stage=k)))
    return out
