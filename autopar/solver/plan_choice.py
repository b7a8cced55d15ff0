"""A plan's own per-operator choices, read back into the solver's tables.

``autopar run --memory`` and ``autopar profile`` predict a plan's memory and step time by solving
its configuration again (every outer choice forced). The per-operator placements that solve picks
depend on the cluster's links, which a plan file does not keep: a plan made for another cluster
(``--cluster FILE``) or edited by hand would be predicted as another plan. ``own_summary`` takes
the tables of that solve and selects, node by node and axis by axis, the strategy the plan names
(its output and input placements on that axis, the same name first), so the prediction is of the
placements that run. With several tensor axes the inner axis' tables hold the tensors as the
solve's outer choices split them (``tensor_axes.py``): exact when the plan's outer choices are
the solve's, an approximation of the local sizes otherwise.
"""
from __future__ import annotations

from typing import Optional

from autopar.mesh import TENSOR
from autopar.solver.problem import AxisSummary, AxisTables, summarize
from autopar.solver.tensor_axes import with_outer_axes


def plan_choice(tab: AxisTables, strategies: dict, axis: int) -> Optional[dict]:
    """key -> index of the strategy of ``tab`` that the plan's ``strategies`` (key -> NodeStrategy)
    choose on mesh axis ``axis``; None when a node has none that matches."""
    choice = {}
    for k in tab.keys:
        ns = strategies.get(k)
        if ns is None:
            return None
        out, ins = ns.output[axis], tuple(p[axis] for p in ns.inputs)
        same = [j for j, st in enumerate(tab.strategies[k])
                if st.output == out and tuple(st.inputs) == ins]
        if not same:
            return None
        choice[k] = next((j for j in same if tab.strategies[k][j].name == ns.name), same[0])
    return choice


def own_summary(solution, plan) -> Optional[AxisSummary]:
    """The summary of ``plan``'s own placements on the tables of ``solution`` (``search.AxisSolution``
    of the plan's forced configuration); None when the tables do not hold every choice."""
    strategies = {s.key: s for s in plan.strategies}
    axes = tuple(plan.mesh_axes)
    if TENSOR not in axes or any(a not in axes for a, _, _ in solution.axes):
        return None
    inner = plan_choice(solution.tables, strategies, axes.index(TENSOR))
    outer = tuple((a, tab, plan_choice(tab, strategies, axes.index(a))) for a, tab, _ in solution.axes)
    if inner is None or any(c is None for _, _, c in outer):
        return None
    return with_outer_axes(summarize(solution.tables, inner), outer, plan.tp)
