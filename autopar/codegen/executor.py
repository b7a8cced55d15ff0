"""Run a RankProgram: an interpreter over the exported FX graph, every value a DTensor.

Per op node: each tensor input is resharded to the plan's input placement (``edge``), the op runs
on DTensors (DTensor's rules compute the local pieces), the output is resharded to the plan's
output placement if DTensor produced another one, and plain tensors (factories such as
``arange``) become replicated DTensors. Parameters enter through ``ParamStore.use`` in each scope
that reads them (the main graph, or a recompute region); the main graph's scope drops a parameter
after its last reader, so a ZeRO-3 gathered weight lives from its first use to its last, not to the
end of the forward.

Gradients. ``edge`` (``edges.py``) is an autograd function: forward redistributes producer -> consumer placement;
backward redistributes the gradient to the producer's output placement (Partial read as
Replicate), which is the solver's cost model (``solver/reshard.py``). Edges into a Replicate input
are wrapped even when nothing moves forward, because the consumer may hand back a Partial gradient
(Megatron's "f"): the all-reduce then happens on that edge, where the plan costs it.

Recompute regions run under ``torch.utils.checkpoint(use_reentrant=False)`` with early stopping
off, so a region's forward collectives are issued again, all of them, during backward.

Fallbacks: an op DTensor has no rule for is probed once per (target, placements) without autograd
(deciding before the real call keeps a region's recomputation identical to its forward) and then
runs on local tensors (``fallback.py``); ``GraphExecutor.fallbacks`` lists them.

Fused kernels (``fused``, see ``fused.py``): an op node whose aten call a registry kernel replaces
exactly under its input placements runs the kernel on local tensors (after the edges, before the
DTensor dispatch); ``GraphExecutor.fused_kernels`` lists (node key, kernel name). Multi-node
regions (``patterns.py``: residual add + norm, RoPE, SwiGLU, ...) are deferred to their last node
(the anchor; their inputs stay alive until then) and run as one kernel there when the plan keeps
every edge inside the region in place and the adapter accepts the operands' placements, both
decided before any edge runs; otherwise the members run one by one.

In-place writes (BatchNorm running statistics, ``num_batches_tracked``, counters and caches a
``forward`` updates): the exported training graph mutates buffer placeholders in place (``add_``,
``copy_``, ``batch_norm(training=True)``). A buffer placeholder is a view of the full buffer this
rank holds (``buffers``), so a write through it updates the buffer; a write to a copy (an edge
moved the value, or the buffer is sharded) is written back in full (``full_tensor``: a collective
only then). Every write happens exactly once per run, as in one process: the probe of an op's
DTensor rule runs on copies of the operands the op writes, and the replay of a recompute region
in backward runs on copies of the values the forward read before writing them (the forward's
values, not the updated ones). ``written_args`` says which operands an op writes.

Local-dp mode (``program.local_dp``, only the DATA axis has size > 1): the graph was traced at
the local batch; nodes run on plain tensors, and only the nodes that reduce over the batch (the
loss) wrap their plain inputs as DTensors (Shard(0) on DATA) to get the global result.

Context parallelism (``context``, cp > 1; ``context_run.py``): the graph was traced at the folded
batch (each sequence's chunk as rows); ``scaled_dot_product_attention`` runs through the cp engine
(ring or Ulysses) and the position sources (``program.positions``) take this rank's positions.
Values computed from them (``program.positional``) differ across the DATA axis' cp ranks, so their
gradient summands stay Partial on DATA, as a parameter's do; so do those of values computed from
parameters alone (a position embedding, with or without cp: ``GraphIR.batch_free``).

Axes: the DeviceMesh has the plan's stage mesh axes in ``program.mesh`` order; the executor finds
the DATA and TENSOR axes by name (``autopar.mesh``), never by position.
"""
from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Optional, Sequence

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Replicate as TReplicate

from autopar.codegen import fallback
from autopar.codegen.causal_check import RuntimeCausalMasks, agree_on_every_rank
from autopar.codegen.context_run import ContextRun
from autopar.codegen.edges import edge, release_masks, resolve, resolve_placements, unmasked
from autopar.codegen.fused import FusedKernels
from autopar.codegen.patterns import Match, find_fusions, node_inputs
from autopar.codegen.program import NodePlan, Placements, Region, RankProgram, axis_index
from autopar.codegen.shards import contiguous_stride, local_ranges, slice_of
from autopar.codegen.writes import buffer_writes, probe_copies, write_back, written_from_outside
from autopar.codegen.vocab_ce import (VOCAB_CE_TARGET, VocabParallelCE, ce_arg, class_sharded_on_tp,
                                      vocab_parallel_ce)
from autopar.ir import SDPA_TARGET
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Replicate, Shard, to_torch

log = logging.getLogger("autopar.codegen")


def _dtensors(args, kwargs) -> list:
    flat: list = []
    fx.node.map_aggregate((args, kwargs), lambda a: flat.append(a) if isinstance(a, DTensor) else None)
    return flat


class _ParamRef:
    """Env marker for a parameter placeholder: resolved per scope (``ParamStore.use``)."""
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


# ---- the executor ----------------------------------------------------------------------------

class GraphExecutor:
    """Executes ``gm`` (an exported graph, placeholders = params, buffers, inputs, target) under
    ``program`` on ``mesh``. ``params`` supplies parameter DTensors; ``buffers`` maps buffer
    names (and lifted-constant placeholder names) to full tensors."""

    def __init__(self, gm: fx.GraphModule, program: RankProgram, mesh, params, buffers: dict,
                 constants: dict, log_paused=contextlib.nullcontext,
                 fused: Optional[FusedKernels] = None, part: Optional[frozenset[str]] = None,
                 want: tuple[str, ...] = (), context: Optional[ContextRun] = None) -> None:
        self.gm = gm
        self.context = context                  # cp > 1: this rank's chunk (``context_run.py``)
        # part: run only these nodes (a pipeline stage, ``stages.py``); values read from outside it
        # come as ``run``'s seed, and ``run`` returns the values of ``want`` instead of the output
        self.part = part
        self.want = tuple(want)
        self.program = program
        self.mesh = mesh
        self.params = params
        self.buffers = buffers
        self.constants = constants
        self.plans = {n.name: n for n in program.nodes}
        if tuple(mesh.mesh_dim_names or ()) != tuple(program.mesh.axes):
            raise ValueError(f"the DeviceMesh's axes {mesh.mesh_dim_names} are not the program's "
                             f"mesh axes {program.mesh.axes}")
        data = axis_index(program.mesh, DATA)
        # a parameter's gradient summand stays Partial on the DATA axis (the reducer sums it)
        self._param_keep = () if data is None else (data,)
        # values computed from parameters (and, cp > 1, this rank's positions) only: their gradient
        # summands stay Partial on DATA too (edges out of them keep the axis), to be summed with
        # the parameter's by the reducer (``RankProgram.positional``)
        self._positional = frozenset(n.name for n in program.nodes if n.key in program.positional)
        self._tensor_axis = axis_index(program.mesh, TENSOR)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                       else torch.device(mesh.device_type))
        self.fallbacks: set[str] = set()        # op targets run on local tensors
        self._regather = getattr(params, "regather", None)   # a ParamStore's (``runtime/regather.py``)
        self._probed: set = set()
        self._fallback_sigs: set = set()
        self.log_paused = log_paused            # context manager: probes are not logged
        self.fused = fused                      # fused-kernel substitution, None = off
        self._matches, self._deferred = self._find_matches() if fused is not None else ({}, {})
        self._units = self._make_units()
        # parameter name -> its placeholders: when the last one is dropped, the scope's gathered
        # weight (ZeRO-3) is dropped with it, not kept to the end of the forward
        self._param_readers: dict[str, int] = {}
        for n in gm.graph.nodes:
            p = self.plans.get(n.name)
            if n.op == "placeholder" and p is not None and p.kind == "param":
                self._param_readers[p.param_name] = self._param_readers.get(p.param_name, 0) + 1
        self._writes, self._region_writes = self._find_writes()
        self._replaying = False                 # a recompute region's replay is running
        self.causal_masks = RuntimeCausalMasks(gm.graph)   # constant masks checked on step 1

    @property
    def fused_kernels(self) -> tuple[tuple[str, str], ...]:
        """(node key, kernel name) of every node run through a fused kernel so far."""
        return tuple(self.fused.used.items()) if self.fused is not None else ()

    def _fused(self, p: NodePlan, args, kwargs):
        if self.fused is None or p.kind != "op":
            return None
        return self.fused.run(p.key, p.target, args, kwargs)

    # ---- structure ----
    def _find_matches(self) -> tuple[dict[str, tuple[Match, list, tuple]], dict[str, str]]:
        """Multi-node fusion regions (``patterns.py``) whose members share one scope (the same
        recompute region, or none) and one mode (all DTensor or all local): anchor name ->
        (match, member nodes, (role, member, input node, input index) per operand), and
        member -> anchor for the members run at their anchor."""
        nodes = {n.name: n for n in self.gm.graph.nodes}
        matches, deferred = {}, {}
        for m in find_fusions(self.gm.graph):
            if self.part is not None and not set(m.members) <= self.part:
                continue                    # a region cut by a stage boundary runs member by member
            plans = [self.plans[n] for n in m.members]
            if len({(p.region, p.dtensor) for p in plans}) != 1 or any(p.strided for p in plans):
                continue
            operands = tuple((role, nodes[o.member], node_inputs(nodes[o.member])[o.index], o.index)
                             for role, o in m.operands)
            matches[m.anchor] = (m, [nodes[n] for n in m.members], operands)
            deferred.update((n, m.anchor) for n in m.members[:-1])
        return matches, deferred

    def _make_units(self) -> list:
        """Top-level units in graph order: ("node", fx.Node) or ("region", Region, [fx.Node]),
        each with the names it reads from earlier units and the names to drop after it."""
        region_of = {name: self.program.regions[p.region] for name, p in self.plans.items()
                     if p.region is not None}
        units: list = []
        unit_of: dict[str, int] = {}
        seen_regions: dict[int, int] = {}
        part = self.part
        for node in self.gm.graph.nodes:
            if part is not None and node.name not in part:
                continue
            r = region_of.get(node.name)
            if r is None:
                unit_of[node.name] = len(units)
                units.append(["node", node])
            elif r.index not in seen_regions:
                seen_regions[r.index] = unit_of[node.name] = len(units)
                names = set(r.nodes)
                if part is not None and not names <= part:
                    raise ValueError(f"recompute region {r.index} ({r.kind}) is cut by a pipeline stage boundary")
                members = [n for n in self.gm.graph.nodes if n.name in names]
                units.append(["region", r, members])
            else:
                unit_of[node.name] = seen_regions[r.index]
        last_use: dict[str, int] = {}
        reads: list[list[str]] = []
        for i, u in enumerate(units):
            members = [u[1]] if u[0] == "node" else u[2]
            inside = {n.name for n in members}
            r = []
            for n in members:
                for a in n.all_input_nodes:
                    if a.name not in inside and a.name not in r:
                        r.append(a.name)
            reads.append(r)
            # a deferred fusion member reads its inputs when its anchor runs
            at = unit_of[self._deferred[u[1].name]] if u[0] == "node" and u[1].name in self._deferred else i
            for name in r:
                last_use[name] = max(last_use.get(name, -1), at)
        for name in self.want:                  # returned by ``run``: never dropped
            last_use[name] = len(units)
        out = []
        for i, u in enumerate(units):
            drop = [name for name, j in last_use.items() if j == i]
            if u[0] == "region":
                produced = {n.name for n in u[2]}
                exported = [name for name, j in last_use.items() if name in produced and j > i]
                out.append(("region", u[1], u[2], reads[i], exported, drop))
            else:
                out.append(("node", u[1], reads[i], drop))
        return out

    def _find_writes(self) -> tuple[dict, dict]:
        """(node name -> ((arg position, buffer name, direct), ...) for the ops that write a buffer
        in place, region index -> names a region reads from outside and writes in place)."""
        writes: dict[str, tuple] = {}
        regions: dict[int, frozenset] = {}
        for u in self._units:
            members = [u[1]] if u[0] == "node" else u[2]
            inside = {n.name for n in members}
            read_written = set()
            for n in members:
                found = buffer_writes(n, self.plans)
                read_written |= written_from_outside(n, inside)
                if found:
                    writes[n.name] = tuple(found)
            if u[0] == "region" and read_written:
                regions[u[1].index] = frozenset(read_written)
        return writes, regions

    def _write_back(self, node: fx.Node, args) -> None:
        """After ``node`` wrote buffers in place (see the module docstring): a write that did not
        land in the whole buffer is copied into it (``writes.write_back``), never in a replay."""
        if self._replaying:
            return
        found = self._writes[node.name]
        write_back(self.buffers, [(name, direct) for _, name, direct in found], [args[i] for i, _, _ in found],
                   node.format_node())

    # ---- running ----
    def run(self, inputs: Sequence[torch.Tensor], target: Optional[torch.Tensor] = None,
            seed: Optional[dict] = None) -> list:
        """Graph outputs (DTensors; buffer mutations first, then the user output); with a ``part``:
        the values of ``want``, ``seed`` giving the values the part reads from outside it."""
        env: dict[str, Any] = dict(seed or {})
        scope: dict[str, DTensor] = {}
        readers = dict(self._param_readers)
        self.causal_masks.begin_step()
        for u in self._units:
            if u[0] == "node":
                _, node, _, drop = u
                if node.op == "output":
                    return [self._value(a, env, scope) if isinstance(a, fx.Node) else a
                            for a in node.args[0]]
                self._step(node, env, scope, inputs, target)
            else:
                _, region, members, reads, exported, drop = u
                self._run_region(region, members, reads, exported, env)
            for name in drop:
                v = env.pop(name, None)
                if isinstance(v, _ParamRef):       # its last reader ran: the scope lets it go
                    readers[v.name] -= 1
                    if not readers[v.name]:
                        scope.pop(v.name, None)
        if self.part is not None:
            return [env[w] for w in self.want]     # boundary values are computed, never parameters
        raise RuntimeError("the graph has no output node")

    def _run_region(self, region: Region, members, reads, exported, env) -> None:
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        # values the region writes in place stay out of checkpoint's saved inputs (they change, which
        # its version check rejects); the replay gets copies of what the forward read instead
        written = self._region_writes.get(region.index, frozenset())
        kept = {n: env[n] for n in reads if n in written}
        saved = {n: v.detach().clone() for n, v in kept.items()
                 if isinstance(v, torch.Tensor)} if torch.is_grad_enabled() else {}
        args = [n for n in reads if n not in written]
        calls = [0]

        def fn(*vals):
            calls[0] += 1
            replay = calls[0] > 1
            local_env = dict(zip(args, vals))
            local_env.update({n: saved[n].clone() if replay and n in saved else v for n, v in kept.items()})
            local_scope: dict[str, DTensor] = {}
            self._replaying, was = replay or self._replaying, self._replaying
            try:
                for node in members:
                    self._step(node, local_env, local_scope, (), None)
            finally:
                self._replaying = was
            return tuple(local_env[n] for n in exported)

        with set_checkpoint_early_stop(False):
            outs = checkpoint(fn, *[env[n] for n in args], use_reentrant=False)
        env.update(zip(exported, outs))

    def _step(self, node: fx.Node, env, scope, inputs, target) -> None:
        """Run ``node`` into ``env``: a fusion member waits for its anchor, which runs them all."""
        if node.name in self._deferred:
            return
        if node.name in self.causal_masks.skip:
            env[node.name] = None                  # a causal mask no call reads any more
            return
        if node.name in self._matches:
            self._run_match(*self._matches[node.name], env, scope, inputs, target)
        else:
            env[node.name] = self._run_node(node, env, scope, inputs, target)

    def _run_match(self, m: Match, members: list, operands: tuple, env, scope, inputs, target) -> None:
        """One kernel for the region ``m`` when its operands' planned placements allow it (decided
        before any edge runs), else its members one by one as usual."""
        ops = {role: self._operand(self.plans[member.name], n, i, env, scope)
               for role, member, n, i in operands}
        key = self.plans[m.anchor].key
        specs = {role: (v, tuple(pl) if pl is not None else ()) for role, (v, pl, _) in ops.items()}
        if self.fused.check_match(key, m, specs, lambda: self._internal_moves(m, specs)):
            outs = self.fused.run_match(key, m, {role: self._edged(*op) for role, op in ops.items()})
            for name, i in m.outputs:
                env[name] = self._fix_output(outs[i], self.plans[name])
            return
        for node in members:
            env[node.name] = self._run_node(node, env, scope, inputs, target)

    def _internal_moves(self, m: Match, specs: dict) -> Optional[str]:
        """Why the region's own edges would move data: every internal value has the placements
        of the data operand (the first), which each internal edge's plan must keep."""
        x, pl = next(iter(specs.values()))
        if not pl:
            return None
        for producer, consumer, i in m.internal:
            wants = [self.plans[producer].output]
            inputs = self.plans[consumer].inputs
            wants.append(inputs[i] if i < len(inputs) else None)
            for want in wants:
                if resolve_placements(pl, x.ndim, want) != pl:
                    return f"the plan reshards {producer} -> {consumer} inside the region"
        return None

    def _value(self, n: fx.Node, env, scope):
        v = env[n.name]
        if isinstance(v, _ParamRef):
            if v.name not in scope:
                scope[v.name] = self.params.use(v.name)
            return scope[v.name]
        return v

    def _run_node(self, node: fx.Node, env, scope, inputs, target):
        p = self.plans[node.name]
        if node.op == "placeholder":
            return self._placeholder(node, p, inputs, target)
        if node.op == "get_attr":
            raise NotImplementedError(f"{node.format_node()}: get_attr nodes are not produced by "
                                      "torch.export's lifted graphs; trace with autopar.trace")
        if node.op != "call_function":
            raise NotImplementedError(f"{node.format_node()}: node op {node.op!r} is not supported")
        mask = self.causal_masks.mask_node(node)
        if mask is not None:
            self.causal_masks.verify(node, self._value(mask, env, scope), self._agree)
        node_args, node_kwargs = self.causal_masks.call(node)
        if self.program.local_dp and not p.dtensor:
            return self._run_plain(node, node_args, node_kwargs, env, scope)
        counter = [0]

        def arg(n: fx.Node):
            counter[0] += 1
            i = counter[0] - 1
            return self._edged(*self._operand(p, n, i, env, scope), saved_by=p.target if i in p.regather else None)

        args = fx.node.map_arg(node_args, arg)
        kwargs = fx.node.map_arg(node_kwargs, arg)
        if node.target is operator.getitem:
            out = args[0][args[1]]
        elif p.strided:
            out = self._strided_split(p, args[0], p.strided)
        elif p.target == VOCAB_CE_TARGET and vocab_parallel_ce(args, kwargs, self.mesh):
            out = VocabParallelCE.apply(args[0], args[1], ce_arg(args, kwargs, 3, "reduction", 1),
                                         ce_arg(args, kwargs, 4, "ignore_index", -100))
        elif p.target == fallback.ASSERT_METADATA and isinstance(args[0], DTensor):
            out = fallback.assert_global_metadata(*args, **kwargs)
        elif self.context is not None and (p.key in self.program.positions or p.target == SDPA_TARGET):
            out = self._context_node(node, p, args, kwargs)
        elif (fused := self._fused(p, args, kwargs)) is not None:
            out = fused
        else:
            if p.target == VOCAB_CE_TARGET and class_sharded_on_tp(args[0], self.mesh):
                self.fallbacks.add(p.target)           # class weight / label smoothing: DTensor gathers
                log.info("%s: vocab-parallel cross-entropy does not support a class weight or label "
                         "smoothing; DTensor gathers the logits", node.name)
            out = self._call(node, p, args, kwargs)
        if node.name in self._writes:
            self._write_back(node, args)
        return self._fix_output(out, p, self._param_keep if node.name in self._positional else ())

    def _operand(self, p: NodePlan, n: fx.Node, i: int, env, scope) -> tuple:
        """(value, placements its edge gives it or None, whether its gradient summand stays
        Partial on DATA: a parameter, or a value of this cp rank's positions) of ``n``, the
        ``i``-th FX-node argument of the node planned by ``p``."""
        is_param = isinstance(env[n.name], _ParamRef) or n.name in self._positional
        v = self._value(n, env, scope)
        if self.program.local_dp and not p.dtensor:
            return v, None, is_param
        if not isinstance(v, DTensor) and isinstance(v, torch.Tensor):
            v = self._wrap_plain(v, n.name)           # local-dp mode: a plain producer
        if not isinstance(v, DTensor):
            return v, None, is_param
        return v, resolve(v, p.inputs[i] if i < len(p.inputs) else None), is_param

    def _edged(self, v, placements: Optional[tuple], is_param: bool, saved_by: Optional[str] = None):
        """``v`` through its edge; ``saved_by``: the target of a consumer that saves it as it is
        (``NodePlan.regather``: a gathered value is kept as its shard, ``runtime/regather.py``)."""
        if placements is None:
            return v
        regather = self._regather if saved_by is not None else None
        v = regather.cast_for(v, saved_by) if regather is not None else v
        return edge(v, placements, self._param_keep if is_param else (), regather)

    def _run_plain(self, node: fx.Node, node_args, node_kwargs, env, scope):
        """Local-dp mode: the op on plain tensors of the local batch (see ``program.py``)."""
        args = fx.node.map_arg(node_args, lambda n: self._value(n, env, scope))
        kwargs = fx.node.map_arg(node_kwargs, lambda n: self._value(n, env, scope))
        if node.target is operator.getitem:
            return args[0][args[1]]
        p = self.plans[node.name]
        if self.context is not None and (p.key in self.program.positions or p.target == SDPA_TARGET):
            return self._context_node(node, p, args, kwargs)
        fused = self._fused(p, args, kwargs)
        if fused is not None:
            return fused
        out = node.target(*args, **kwargs)
        if node.name in self._writes:
            self._write_back(node, args)
        return out

    def _context_node(self, node: fx.Node, p: NodePlan, args, kwargs):
        """cp > 1: attention over the cp ranks, or a position source's values for this chunk."""
        if p.target == SDPA_TARGET:
            return self.context.attention(args, kwargs)
        return self.context.position_value(p.target, node.target(*args, **kwargs), args)

    def _agree(self, flag: bool) -> bool:
        """True only if ``flag`` is True on every rank (one MIN all-reduce, not logged)."""
        return agree_on_every_rank(flag, self.device, self.log_paused)

    def _wrap_plain(self, t: torch.Tensor, producer: str) -> DTensor:
        """A plain local-batch tensor entering a DTensor node: its planned placement, its global
        shape (the batch dim sharded evenly: local-dp mode requires dp | batch)."""
        want = self.plans[producer].output or (None,) * self.mesh.ndim
        pl = tuple(TReplicate() if w is None or isinstance(w, Partial) else
                   to_torch(Shard(w.dim + t.dim()) if isinstance(w, Shard) and w.dim < 0 else w) for w in want)
        return DTensor.from_local(t, self.mesh, pl, run_check=False)

    def _call(self, node: fx.Node, p: NodePlan, args, kwargs):
        dts = _dtensors(args, kwargs)
        if not dts:
            return node.target(*args, **kwargs)
        sig = (p.target, tuple(tuple(a.placements) for a in dts))
        if sig not in self._probed:
            self._probed.add(sig)
            # CPU attention has no DTensor rule, and finding that out through DTensor's
            # decomposition-based propagation takes minutes with a mask (HF LLaMA): not probed
            if (p.target in fallback.SDPA_TARGETS and self.device.type == "cpu") or \
                    fallback.needs_local(p.target, sig[1]) or self._lacks_rule(node, p, args, kwargs):
                self.fallbacks.add(p.target)
                self._fallback_sigs.add(sig)
        if sig in self._fallback_sigs:
            return self._run_local(node, p, args, kwargs)
        return node.target(*args, **kwargs)

    def _lacks_rule(self, node: fx.Node, p: NodePlan, args, kwargs) -> bool:
        """Probe once per (target, placements), without autograd and with the collective log
        paused, whether DTensor can run the op. Deciding before the real call keeps a recompute
        region's replay identical to its forward."""
        args = probe_copies(node.target, args)      # the probe must not write: copies of the written operands
        try:
            with torch.no_grad(), self.log_paused():
                release_masks(node.target(*args, **kwargs))
        except NotImplementedError as e:
            if "sharding strategy" not in str(e) and "sharding propagation" not in str(e):
                raise
            log.info("DTensor has no sharding rule inside %s (%s); running it on local tensors "
                        "(see autopar/codegen/fallback.py)", p.target, str(e).splitlines()[0][:160])
            return True
        return False

    def _run_local(self, node: fx.Node, p: NodePlan, args, kwargs):
        return fallback.run_local(node.target, p.target, args, kwargs, self.mesh)

    def _strided_split(self, p: NodePlan, x: DTensor, k: int) -> tuple:
        """Split a strided TENSOR-axis shard into its k chunks locally (see ``program.py``)."""
        dim = x.placements[self._tensor_axis].dim
        shape = list(x.shape)
        shape[dim] //= k
        return tuple(DTensor.from_local(c, self.mesh, x.placements, run_check=False,
                                        shape=torch.Size(shape), stride=contiguous_stride(shape))
                     for c in torch.chunk(x.to_local(), k, dim=dim))

    def _fix_output(self, out, p: NodePlan, keep: tuple[int, ...] = ()):
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and not self.program.local_dp:
            out = DTensor.from_local(out, self.mesh, tuple(TReplicate() for _ in range(self.mesh.ndim)),
                                     run_check=False)
        if p.output is None:
            return out

        def fixed(o: DTensor) -> DTensor:
            o = unmasked(o)
            return edge(o, resolve(o, p.output), keep)

        if isinstance(out, DTensor):
            return fixed(out)
        if isinstance(out, (tuple, list)):
            return type(out)(fixed(o) if isinstance(o, DTensor) else o for o in out)
        return out

    def _placeholder(self, node: fx.Node, p: NodePlan, inputs, target):
        if p.kind == "param":
            return _ParamRef(p.param_name)
        if p.kind == "buffer":
            value = self.buffers.get(p.param_name) if p.param_name else self.constants[node.name]
            return self._distribute(value, p.output)
        if p.key == "|target|0":
            if target is None:
                raise ValueError("this graph computes the loss: pass the target")
            return self._distribute(target, p.output)
        i = int(p.key.rsplit("|", 1)[1])
        if i >= len(inputs):
            raise ValueError(f"the graph takes {i + 1}+ inputs, got {len(inputs)}")
        return self._distribute(inputs[i], p.output)

    def _distribute(self, t: torch.Tensor, want: Optional[Placements]) -> DTensor:
        """A full tensor every rank holds -> this rank's shard (no communication)."""
        pl = tuple(Replicate() if w is None or isinstance(w, Partial) else w
                   for w in (want or (None,) * self.mesh.ndim))
        pl = tuple(Shard(w.dim + t.dim()) if isinstance(w, Shard) and w.dim < 0 else w for w in pl)
        ranges = local_ranges(t.shape, pl, tuple(self.mesh.shape), tuple(self.mesh.get_coordinate()))
        local = slice_of(t, ranges) if t.dim() else t
        if self.program.local_dp:
            return local.to(self.device)
        d = DTensor.from_local(local.to(self.device).contiguous(), self.mesh, tuple(to_torch(x) for x in pl),
                               run_check=False, shape=t.shape, stride=contiguous_stride(t.shape))
        return d


