"""Emitted code: one ``torch.fx.GraphModule`` per graph part, the plan's placements explicit.

    gm = emit_stage(graph, program, cut=cut, stage=k)   # graph: the FULL trace the program is for
    print(gm.code)                                      # `autopar inspect plan.json --code`
    bind(gm, mesh=stage_mesh, params=store, buffers=buffers, constants=constants_of(graph))
    loss = gm(input_ids, target)                        # DTensors (or full tensors) on the mesh

What runs where. Training runs these modules (``autoparallelize(engine="auto"|"emitted")``,
``autopar/engine.py``): ``emit_part`` makes one per graph part -- the whole graph (pp == 1: the
micro-batch loop of ``api.py`` calls it), or each pipeline stage's part and the loss part (the
``StageModule``s of ``runtime/pipeline.py`` and the schedule's loss function call them) -- behind
``engine.EmittedRunner``, the interpreter's interface (``run(inputs, target, seed) -> list``).
The micro-batch loop, gradient reduction, ZeRO and pipeline schedules stay with the runtime; the
backward is autograd's through the emitted calls. ``emit_stage`` prints a stage as ``inspect``
shows it (the last stage with its loss part).

A module's ``forward`` takes the values its part reads from outside (a later stage: what the stage
before sends, in their wire placements, ``stages.wire_placements``), then the model inputs (the
target last). Each parameter enters through ``param(rt, name)`` (``rt = self.rt``, set by ``bind``:
``params.use(name)``, once per scope, as the interpreter); each op node is the same aten call on
DTensors. Placements are strings, one entry per stage-mesh axis in its order (``S(0)R``; ``_`` =
keep what the value has). On every edge where the consumer's planned input placement differs from
the producer's: ``redistribute(x, 'RR')`` (``edges.edge``: backward to the producer's placement,
the solver's cost model); where they agree but the input is Replicate on an axis of size > 1 and
the value may carry a gradient: ``replicated_input(x, 'RR')`` (Megatron's "f"). After every op
whose plan fixes an output placement: ``pin(rt, x, 'S(0)R')`` -- the interpreter's
``_fix_output``: a move where DTensor's rule gave another placement (e.g. P -> R), nothing
otherwise -- so every later edge starts from the plan's placement and the collectives are the
interpreter's (``expected.py``'s). Inputs and buffers enter with ``place(rt, x, 'S(0)R')`` (a full
tensor every rank holds -> its shard, no communication). Special ops are calls of named functions
running the interpreter's code (``emit_runtime.py``): ``vocab_parallel_cross_entropy``
(``vocab_ce.py``), ``strided_split`` (fused QKV), ``local_op`` (attention on the CPU, split
convolutions, and any op without a registered DTensor rule: probed once per placements, unlogged,
then run on local tensors if DTensor cannot, as the interpreter's ``_call``),
``assert_global_metadata``, and under context parallelism (cp > 1) ``context_attention`` (ring or
Ulysses over the cp ranks) and ``context_positions`` (a position source given this rank's chunk's
positions), the interpreter's ``ContextRun`` (``context_run.py``), whose values' gradient summands
stay Partial on the data axis up to the reducer (``program.positional``); a recompute region is a
submodule ``self.recompute_<i>`` run by ``recompute(...)`` (``torch.utils.checkpoint``,
non-reentrant, early stop off). In-place buffer writes (BatchNorm statistics, counters, caches):
an op that writes a buffer is followed by ``write_back(rt, out, ...)``, which copies a write that
landed in a moved or sharded copy into the full buffer (gathered), once per step; a probe writes
copies, and a region that writes what it reads gets ``written=`` positions, kept out of
checkpoint's saved inputs, its replay running on copies of what the forward read with no write-back
(the interpreter's ``_write_back`` and ``_run_region``). An attention with a constant mask the
trace could not fold calls ``masked_attention``: checked on the first step, every rank agreeing,
and from the next step on causal ones run ``is_causal=True`` (the mask is still computed: the
interpreter stops computing it). Local-dp mode (``program.local_dp``): the plain nodes are plain
aten calls on the local batch; a DTensor node (the loss) wraps its plain operands
(``wrap_plain``), as the interpreter.

The interpreter (``executor.GraphExecutor``) is still needed, and chosen by ``engine="auto"``
(``engine.emission_gap``, decided alike on every rank before the first step), for:
- fused kernels (``kernels="on"``, or "auto" on CUDA): whether a node or region runs a kernel is
  decided at run time from its operands' actual placements and the adapters' checks
  (``fused.py``, ``patterns.py``), and a region defers its members to its anchor;
- ops that have a registered DTensor rule that nonetheless rejects the plan's placements are not
  probed here (the executor probes every op once): such a plan fails on its first step with
  DTensor's error; ``engine="interpreter"`` runs it.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
from torch import fx, nn

from autopar.codegen import fallback
from autopar.codegen.causal_check import RuntimeCausalMasks
from autopar.codegen.emit_runtime import (StageRuntime, buffer, context_attention, context_positions, fmt,
                                          forced_local_op, has_dtensor_rule, local_op, masked_attention, norm, param,
                                          parse, pin, place,
                                          recompute, redistribute, redistribute_saved, replicated_input, strided_split,
                                          vocab_parallel_cross_entropy, wrap_plain, write_back)
from autopar.codegen.program import RankProgram, axis_index, compile_program
from autopar.codegen.stages import PipelineCut, wire_placements
from autopar.codegen.vocab_ce import VOCAB_CE_TARGET
from autopar.codegen.writes import buffer_writes, written_from_outside
from autopar.ir import SDPA_TARGET, GraphIR
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Replicate, Shard

__all__ = ["emit_stage", "emit_part", "bind", "constants_of", "emit_plan", "fmt", "parse", "StageRuntime"]


def _tensor_meta(n: fx.Node):
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


class _Emitter:
    def __init__(self, gm: fx.GraphModule, program: RankProgram, fallbacks: frozenset,
                 known: Optional[dict] = None) -> None:
        self.gm, self.program = gm, program
        self.masks = RuntimeCausalMasks(gm.graph)     # attention with a constant, unfolded mask
        self.plans = {n.name: n for n in program.nodes}
        self.axes = tuple(program.mesh.axes)
        self.sizes = tuple(program.mesh.shape)
        self.data, self.tensor = axis_index(program.mesh, DATA), axis_index(program.mesh, TENSOR)
        self.fallbacks = fallbacks
        self.local_dp = bool(program.local_dp)
        self.known = dict(known or {})       # name -> placements a value enters with (a received value)
        self.grad: dict[str, bool] = {}       # name -> the value may require grad (from a parameter)
        self.root = nn.Module()
        self.root.rt = None
        self.param_storage = {p.name: p.placements(self.axes) for p in program.params}   # per mesh axis

    def plain(self, name: str) -> bool:
        """Local-dp mode: the value is a plain tensor of the local batch."""
        return self.local_dp and not self.plans[name].dtensor

    def have(self, n: fx.Node, ndim: int):
        """The placements node ``n``'s value has in the emitted code (None: not known statically)."""
        if n.name in self.known:
            return norm(self.known[n.name], ndim)
        p = self.plans.get(n.name)
        if p is None:
            return None
        if p.kind == "param":
            return self.param_storage.get(p.param_name, tuple(Replicate() for _ in self.axes))
        if p.output is None or any(x is None for x in p.output):
            return None
        return norm(p.output, ndim)

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
        if len(inner) != len(names & set(self.plans)):
            raise NotImplementedError(f"recompute region {region.index} ({region.kind}) is cut by a pipeline "
                                      "stage boundary")
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
        written = _written_reads(inner, names, reads)
        call = g.call_function(recompute, (g.get_attr(attr), rt, *[env[n] for n in reads]),
                               {"written": written} if written else {})
        for i, name in enumerate(used_after):
            env[name] = g.call_function(operator.getitem, (call, i), name=name)

    def node(self, node: fx.Node, g: fx.Graph, env: dict, rt: fx.Node, params: dict) -> None:
        p = self.plans[node.name]
        meta = _tensor_meta(node)
        if node.op == "placeholder":
            self.grad[node.name] = p.kind == "param" and meta is not None and meta.is_floating_point()
            if p.kind == "buffer":
                name = p.param_name or node.name
                env[node.name] = g.call_function(buffer, (rt, name, fmt(self.placed(p, node))), name=node.name)
            return                           # inputs: made by the caller; parameters: on first use
        if node.op != "call_function":
            raise NotImplementedError(f"{node.format_node()}: node op {node.op!r} is not emitted")
        writes = buffer_writes(node, self.plans)
        self.grad[node.name] = any(self.grad.get(a.name, False) for a in node.all_input_nodes) and (
            meta is None or meta.is_floating_point())
        if self.plain(node.name):            # local-dp mode: the op on plain local tensors, no edges
            args = fx.node.map_arg(node.args, lambda a: self.value(a, g, env, rt, params))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: self.value(a, g, env, rt, params))
            out = self.call(node, p, g, rt, args, kwargs)
            out = out if out is not None else g.call_function(node.target, args, kwargs, name=node.name)
            env[node.name] = self.written(out, writes, p, g, rt, args)
            return
        counter = [0]

        def arg(a: fx.Node):
            i = counter[0]
            counter[0] += 1
            ap = self.plans[a.name]
            v = self.value(a, g, env, rt, params)
            meta_a = _tensor_meta(a)
            if meta_a is None:
                return v
            nd = meta_a.dim()
            if self.plain(a.name):           # local-dp mode: a plain producer wrapped for a DTensor node
                wrapped = tuple(Replicate() if w is None or isinstance(w, Partial) else w
                                for w in (ap.output or (None,) * len(self.axes)))
                v = g.call_function(wrap_plain, (rt, v, fmt(norm(wrapped, nd))))
                have = norm(wrapped, nd)
            else:
                have = self.have(a, nd)
            want = p.inputs[i] if p.inputs and i < len(p.inputs) and p.inputs[i] is not None \
                else (None,) * len(self.axes)
            want = norm(want, nd)
            keep_axis = self.data if (ap.kind == "param" or ap.key in self.program.positional) else None
            kw = {"keep_partial_grad": self.axes[keep_axis]} if keep_axis is not None else {}
            resolved = tuple(h if w is None or (isinstance(w, Partial) and isinstance(h, Partial)) else w
                             for h, w in zip(have, want)) if have is not None else None
            if resolved is None or resolved != have:
                if i in p.regather:
                    return g.call_function(redistribute_saved, (rt, v, fmt(want), p.target), kw)
                return g.call_function(redistribute, (v, fmt(want)), kw)
            if self.grad.get(a.name, False) and any(isinstance(w, Replicate) and n > 1 and j != keep_axis
                                                    for j, (w, n) in enumerate(zip(resolved, self.sizes))):
                return g.call_function(replicated_input, (v, fmt(want)), kw)
            return v

        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        t = p.target
        context = self.call(node, p, g, rt, args, kwargs)
        if context is not None:
            out = context
        elif p.strided:
            out = g.call_function(strided_split, (args[0], p.strided), name=node.name)
        elif t == VOCAB_CE_TARGET and self._maybe_class_sharded(p, node):
            out = g.call_function(vocab_parallel_cross_entropy, args, kwargs, name=node.name)
        elif t == fallback.ASSERT_METADATA:
            out = g.call_function(fallback.assert_global_metadata, args, kwargs, name=node.name)
        elif t in self.fallbacks:
            out = g.call_function(forced_local_op, (node.target, *args), kwargs, name=node.name)
        elif t in fallback.OWN_LOCAL_TARGETS or not has_dtensor_rule(node.target):
            out = g.call_function(local_op, (rt, node.target, *args), kwargs, name=node.name)
        else:
            out = g.call_function(node.target, args, kwargs, name=node.name)
        out = self.written(out, writes, p, g, rt, args)
        factory = meta is not None and not any(
            isinstance(v, torch.Tensor) for a in node.all_input_nodes
            for v in torch.utils._pytree.tree_leaves(a.meta.get("val")))
        if p.output is not None or (factory and not self.local_dp):
            keep = (self.axes[self.data],) if p.key in self.program.positional and self.data is not None else ()
            out = g.call_function(pin, (rt, out, fmt(norm(p.output or (None,) * len(self.axes),
                                                          meta.dim() if meta is not None else 0)), *keep),
                                  name=f"{node.name}_pinned")
        env[node.name] = out

    @staticmethod
    def written(out: fx.Node, writes: tuple, p, g: fx.Graph, rt: fx.Node, args) -> fx.Node:
        """``out`` after ``write_back`` of what its op wrote in place (nothing without ``writes``)."""
        if not writes:
            return out
        return g.call_function(write_back, (rt, out, p.target, tuple((name, direct) for _, name, direct in writes),
                                            *(args[i] for i, _, _ in writes)), name=f"{out.name}_written")

    def call(self, node: fx.Node, p, g: fx.Graph, rt: fx.Node, args, kwargs) -> Optional[fx.Node]:
        """cp > 1: attention over the cp ranks, or a position source given this rank's chunk's
        positions (the interpreter's ``_context_node``); else an attention whose constant mask is
        checked on the first step (``masked_attention``); None for any other node."""
        if not self.program.context:
            if self.masks.mask_node(node) is None:
                return None
            return g.call_function(masked_attention, (rt, node.name, not self.plain(node.name), node.target, *args),
                                   kwargs, name=node.name)
        if p.target == SDPA_TARGET:
            return g.call_function(context_attention, (rt, *args), kwargs, name=node.name)
        if p.key in self.program.positions:
            return g.call_function(context_positions, (rt, node.target, p.target, *args), kwargs, name=node.name)
        return None

    def value(self, a: fx.Node, g: fx.Graph, env: dict, rt: fx.Node, params: dict):
        ap = self.plans[a.name]
        if ap.kind == "param" and a.name not in env:
            if ap.param_name not in params:
                params[ap.param_name] = g.call_function(param, (rt, ap.param_name), name=_ident(ap.param_name))
            return params[ap.param_name]
        return env[a.name]

    def placed(self, p, node: fx.Node) -> tuple:
        meta = _tensor_meta(node)
        want = p.output or (None,) * len(self.axes)
        return norm(tuple(Replicate() if w is None else w for w in want), meta.dim() if meta is not None else 0)

    def _maybe_class_sharded(self, p, node: fx.Node) -> bool:
        """The executor decides the vocab-parallel loss at run time (``vocab_parallel_ce``): emit
        it wherever the logits may be class-sharded on an axis of size > 1."""
        if self.tensor is None or self.sizes[self.tensor] == 1:
            return False
        if not p.inputs or p.inputs[0] is None or p.inputs[0][self.tensor] is None:
            return True
        w = p.inputs[0][self.tensor]
        nd = _tensor_meta(node.args[0]).dim()
        return isinstance(w, Shard) and w.dim % nd == 1


def _written_reads(inner: list, names: set, reads: list) -> tuple[int, ...]:
    """Positions in ``reads`` (what a recompute region reads from outside) of the values its ops
    write in place (``emit_runtime.recompute``)."""
    written = set().union(*(written_from_outside(n, names) for n in inner))
    return tuple(i for i, name in enumerate(reads) if name in written)


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def emit_part(graph: GraphIR, program: RankProgram, *, part: Optional[frozenset] = None, want: tuple = (),
              recv: Optional[tuple] = None, device: Any = "cpu", fallbacks=(), wire_out: bool = False,
              gm: Optional[fx.GraphModule] = None, class_name: str = "Emitted",
              outputs: Optional[tuple] = None) -> fx.GraphModule:
    """The GraphModule running the nodes of ``part`` (None: the whole graph) of ``graph`` under
    ``program``, as ``GraphExecutor(part=part, want=want)`` runs them. ``forward`` takes the values
    read from outside ``part`` (``recv`` order, else graph order; received in their wire placements,
    ``stages.wire_placements``), then the input placeholders of ``part`` in graph order (the target
    last); it returns the values of ``want`` (``wire_out``: moved to their wire placements), or with
    ``part`` None every graph output. ``gm``: the graph already on its device (else made here);
    ``outputs``: return only these of the results (one: the value itself, not a tuple)."""
    from autopar.trace import graph_on_device

    gm = gm if gm is not None else graph_on_device(graph, device)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    names = {n.name for n in nodes} if part is None else set(part)
    members = [n for n in nodes if n.name in names]
    if recv is None:
        recv = tuple(dict.fromkeys(a.name for n in members for a in n.all_input_nodes if a.name not in names))
    plans = {n.name: n for n in program.nodes}
    known = {name: wire_placements(plans[name].output, len(program.mesh.axes)) for name in recv
             if not (program.local_dp and not plans[name].dtensor)}
    em = _Emitter(gm, program, frozenset(fallbacks), known)
    by_name = {n.name: n for n in gm.graph.nodes}
    g = fx.Graph()
    rt = g.get_attr("rt")
    env: dict[str, fx.Node] = {}
    for name in recv:
        env[name] = g.placeholder(name)
        em.grad[name] = True
    for n in members:
        if em.plans[n.name].kind == "input":
            ph = g.placeholder(n.name)
            env[n.name] = g.call_function(place, (rt, ph, fmt(em.placed(em.plans[n.name], n))),
                                          name=f"{n.name}_placed")
            em.grad[n.name] = False
    em.emit([n for n in members if n.name not in env], g, env, rt)
    if part is None:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        results = [env[a.name] if isinstance(a, fx.Node) else a for a in out_node.args[0]]
    else:
        results = []
        for name in want:
            v = env[name]
            if wire_out:                     # boundary values cross in the wire placements
                wire = wire_placements(em.plans[name].output, len(em.axes))
                v = g.call_function(redistribute, (v, fmt(norm(wire, _tensor_meta(by_name[name]).dim()))))
            results.append(v)
    if outputs is not None:
        results = [results[i] for i in outputs]
    g.output(results[0] if outputs is not None and len(results) == 1 else tuple(results))
    g.lint()
    return fx.GraphModule(em.root, g, class_name=class_name)


def emit_stage(graph: GraphIR, program: RankProgram, *, cut: Optional[PipelineCut] = None, stage: int = 0,
               device: Any = "cpu", fallbacks=()) -> fx.GraphModule:
    """The GraphModule of stage ``stage`` (``cut`` None: the whole graph, pp == 1) under
    ``program`` (a DTensor program of the full trace ``graph``); see the module docstring.
    ``fallbacks``: op targets to run on local tensors (``GraphExecutor.fallbacks`` of a run)."""
    from torch.export.graph_signature import OutputKind

    if program.local_dp:
        raise NotImplementedError("local-dp programs are printed from a DTensor program: compile it with "
                                  "local_dp=None")
    if cut is None:
        specs = graph.exported.graph_signature.output_specs
        user = tuple(i for i, s in enumerate(specs) if s.kind == OutputKind.USER_OUTPUT)
        return emit_part(graph, program, device=device, fallbacks=fallbacks, class_name="Stage0", outputs=user)
    if not 0 <= stage < len(cut.stages):
        raise ValueError(f"stage {stage} is out of range: the plan has {len(cut.stages)} stages (0.."
                         f"{len(cut.stages) - 1})")
    sc = cut.stages[stage]
    last = stage == len(cut.stages) - 1
    names = frozenset(sc.nodes) | (frozenset(cut.loss) if last else frozenset())
    if last and cut.target:
        return emit_part(graph, program, part=names, want=(cut.loss_output,), recv=tuple(sc.recv), device=device,
                         fallbacks=fallbacks, class_name=f"Stage{stage}", outputs=(0,))
    return emit_part(graph, program, part=names, want=tuple(sc.send), recv=tuple(sc.recv), device=device,
                     fallbacks=fallbacks, wire_out=True, class_name=f"Stage{stage}")


def constants_of(graph: GraphIR, device: Any = "cpu") -> dict:
    """The lifted constants the graph's buffer placeholders read (name -> tensor)."""
    spec = {s.arg.name: s.target for s in graph.exported.graph_signature.input_specs if hasattr(s.arg, "name")}
    return {n.name: graph.exported.constants[spec[n.name]].to(device)
            for n in graph.nodes if n.kind == "buffer" and n.param_name is None}


def bind(gm: fx.GraphModule, *, mesh, params, buffers: Optional[dict] = None, constants: Optional[dict] = None,
         local_dp: bool = False, log_paused=None, context=None) -> fx.GraphModule:
    """Make ``gm`` runnable on ``mesh`` (the stage's DeviceMesh, axes named as the plan's);
    ``local_dp``: the program's local-dp mode; ``log_paused``: see ``StageRuntime``; ``context``:
    this rank's ``context_run.ContextRun`` (cp > 1)."""
    import contextlib

    gm.rt = StageRuntime(mesh, params, buffers, constants, local_dp, log_paused or contextlib.nullcontext, context)
    return gm


def emit_plan(plan, stage: Optional[int] = None) -> list[tuple[str, fx.GraphModule]]:
    """(header, module) per stage of a saved plan (``stage``: only that one): the model rebuilt
    from ``plan.model_name`` on the meta device at one micro-batch, traced in full as the runtime
    does (``autopar inspect plan.json --code``)."""
    from autopar.codegen.stages import cut_pipeline
    from autopar.models import build_model
    from autopar.trace import trace_model

    n = len(plan.stages) if plan.pp > 1 else 1
    if stage is not None and not 0 <= stage < n:
        raise ValueError(f"--stage {stage} is out of range: the plan has {n} stage{'s' if n > 1 else ''} (0..{n - 1})")
    try:
        b = build_model(plan.model_name, batch=plan.global_batch // plan.num_micro_batches,
                        seq_len=plan.seq_len, device="meta")
    except Exception as e:                  # a user file that moved, a spec this version lacks
        raise ValueError(f"cannot rebuild the plan's model {plan.model_name!r} to emit its code: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    xs, y = b.example_inputs, b.example_target
    if plan.context_parallel > 1:            # the runtime traces the folded batch (``context_run.py``)
        from autopar.codegen.context_run import ContextRun

        ctx = ContextRun.make(None, 0, plan.context_parallel, plan.context_parallel_mode, plan.seq_len, plan.dp,
                              "meta")
        xs, y = tuple(ctx.fold(x) for x in xs), ctx.fold(y)
    graph = trace_model(b.module, xs, loss_fn=b.loss_fn, example_target=y, collapse_repeats=False, model_name=b.name)
    program = compile_program(graph, plan)
    cut = cut_pipeline(graph, plan) if plan.pp > 1 else None
    mesh = plan.stage_mesh.describe()
    out = []
    for k in range(n) if stage is None else (stage,):
        st = plan.stages[k] if k < len(plan.stages) else None
        layers = f"layers {st.first_layer}..{st.last_layer - 1}" if st is not None else "all layers"
        out.append((f"stage {k}: {layers}, mesh {mesh}", emit_stage(graph, program, cut=cut, stage=k)))
    return out
