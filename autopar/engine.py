"""Which engine runs a ParallelModel's graph parts: the emitted modules or the interpreter.

    autoparallelize(..., engine="auto")     # emitted where it covers the plan, else the interpreter
    pm.engine, pm.engine_reason             # "emitted" / "interpreter", and why

``"emitted"``: one ``torch.fx.GraphModule`` per graph part (``codegen/emit.py``; the whole graph,
or each pipeline stage's part and the loss part), called through ``EmittedRunner``, which offers
the interpreter's interface (``run(inputs, target, seed) -> list``, ``fallbacks``,
``fused_kernels``), so the micro-batch loop (``api.py``) and the pipeline stages
(``runtime/pipeline.py``) run either. ``"interpreter"``: ``codegen/executor.GraphExecutor``.

The choice is made once, before the first step, from what every rank has alike (the traced graph,
the program, the pipeline cut, the fused-kernel settings): ``emission_gap`` emits EVERY
part of the graph (not only this rank's stages), so every rank takes the same path. ``"auto"``
falls back to the interpreter on a gap and records it (``pm.engine_reason``, logged);
``"emitted"`` raises ``EngineError`` naming the gap, on every rank.
"""
from __future__ import annotations

import logging
from typing import Optional

from torch import fx

from autopar.codegen.stages import TARGET_KEY

log = logging.getLogger("autopar.runtime")

ENGINES = ("auto", "emitted", "interpreter")


class EngineError(ValueError):
    """``engine="emitted"`` on a plan the emitted modules do not cover."""


class EmittedRunner:
    """An emitted part (``emit.emit_part``, bound) behind the executor's interface."""

    def __init__(self, gm: fx.GraphModule, recv: tuple, inputs: tuple, part: Optional[frozenset] = None) -> None:
        self.gm = gm
        self.part = part                    # the graph nodes it runs (None: all), as GraphExecutor.part
        self.recv = recv                    # names of the values read from outside the part
        self.inputs = inputs                # (placeholder key) per input placeholder, forward's order
        # per input placeholder: the model input's index, or None for the target
        self._slots = tuple(None if k == TARGET_KEY else int(k.rsplit("|", 1)[1]) for k in inputs)

    @property
    def fallbacks(self) -> set:
        return self.gm.rt.fallbacks

    @property
    def fused_kernels(self) -> tuple:
        return ()

    @property
    def causal_masks(self):
        """Constant attention masks' verdicts (``causal_check.MaskVerdicts``), as the executor's."""
        return self.gm.rt.masks

    def run(self, inputs, target=None, seed: Optional[dict] = None) -> list:
        self.gm.rt.masks.begin_step()       # verdicts of earlier steps apply (the executor's begin_step)
        seed = seed or {}
        args = [seed[name] for name in self.recv]
        for i in self._slots:
            if i is None:
                if target is None:
                    raise ValueError("this graph computes the loss: pass the target")
                args.append(target)
            else:
                if i >= len(inputs):
                    raise ValueError(f"the graph takes {i + 1}+ inputs, got {len(inputs)}")
                args.append(inputs[i])
        out = self.gm(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]


def _parts(cut) -> list[tuple[Optional[frozenset], tuple]]:
    """(part, want) of every graph part: the whole graph, or each stage's and the loss part."""
    if cut is None:
        return [(None, ())]
    parts = [(frozenset(sc.nodes), tuple(sc.send)) for sc in cut.stages]
    return parts + ([(frozenset(cut.loss), (cut.loss_output,))] if cut.loss else [])


def emission_gap(graph, program, cut, *, fused=None, device="cpu") -> tuple[Optional[str], dict]:
    """(why the emitted modules cannot run this graph, or None; the emitted module per part).
    Deterministic: the same on every rank (it reads only what every rank has alike)."""
    from autopar.codegen.emit import emit_part
    from autopar.trace import graph_on_device

    if fused is not None:
        return ("fused kernels (kernels='on', or 'auto' on CUDA): the substitution is decided per node from the "
                "operands' run-time placements (codegen/fused.py); pass kernels='off' to train on the emitted "
                "modules"), {}
    gm = graph_on_device(graph, device)
    modules = {}
    for part, want in _parts(cut):
        try:
            modules[part] = emit_part(graph, program, part=part, want=want, gm=gm)
        except NotImplementedError as e:
            return " ".join(str(e).split()), {}
    return None, modules


def decide(requested: str, graph, program, cut, *, fused=None, device="cpu"
           ) -> tuple[str, str, dict]:
    """(engine, reason, emitted module per part) for ``requested`` ("auto", "emitted", "interpreter")."""
    if requested not in ENGINES:
        raise ValueError(f"engine={requested!r}: choose one of {', '.join(repr(e) for e in ENGINES)}")
    if requested == "interpreter":
        engine, reason, modules = "interpreter", "engine='interpreter' was asked for", {}
    else:
        gap, modules = emission_gap(graph, program, cut, fused=fused, device=device)
        if gap is not None and requested == "emitted":
            raise EngineError(f"engine='emitted' cannot run this plan: the emitted code does not cover {gap}; "
                              "use engine='interpreter' or engine='auto'")
        engine, reason = ("emitted", "the emitted modules cover the plan") if gap is None else (
            "interpreter", f"the emitted code does not cover {gap}")
    log.info("engine: %s (%s)", engine, reason)
    return engine, reason, modules


def forward_modules(engine: str, graph, program, cut, *, fused=None, device="cpu") -> dict:
    """A forward-only graph's (``pm(inputs)``) emitted modules per part: under the training
    engine "emitted" where they cover it (else the interpreter, logged), none under "interpreter"."""
    if engine == "interpreter":
        return {}
    gap, modules = emission_gap(graph, program, cut, fused=fused, device=device)
    if gap is not None:
        log.info("the forward-only graph runs on the interpreter: the emitted code does not cover %s", gap)
    return modules


def make_runner(pm, graph, program, part: Optional[frozenset], want: tuple, module: Optional[fx.GraphModule]):
    """The runner of ``part`` of ``graph`` for ParallelModel ``pm``: ``module`` (an emitted part,
    bound here) behind ``EmittedRunner``, or (None) a ``GraphExecutor``."""
    from autopar.codegen.emit import bind, constants_of
    from autopar.codegen.executor import GraphExecutor
    from autopar.codegen.fused import FusedKernels
    from autopar.trace import graph_on_device

    constants = constants_of(graph, pm.device)
    if module is not None:
        bind(module, mesh=pm.mesh, params=pm.store, buffers=pm._buffers, constants=constants,
             local_dp=bool(program.local_dp), log_paused=pm._log.paused, context=pm._context)
        plans = {n.name: n for n in program.nodes}
        phs = [n for n in module.graph.nodes if n.op == "placeholder"]
        recv = tuple(n.name for n in phs if plans[n.name].kind != "input")
        inputs = tuple(plans[n.name].key for n in phs if plans[n.name].kind == "input")
        return EmittedRunner(module, recv, inputs, part)
    gm = graph_on_device(graph, pm.device)
    fused = None if pm._fused is None else FusedKernels(pm._fused.implementation)
    return GraphExecutor(gm, program, pm.mesh, pm.store, pm._buffers, constants, pm._log.paused,
                         fused, part=part, want=want, context=pm._context)
