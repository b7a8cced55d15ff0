"""``explain(result, key, placement)``: why did the solver not pick this placement for this node?

Two answers, both from the solver's own cost tables (per micro-batch, whole model):
- local: swap only this node to the best strategy with the asked-for output placement, every other
  node as chosen; the difference in node cost and in the resharding on its edges, itemized;
- global: re-solve the tp-axis ILP with the node pinned to that placement (the rest may adapt).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Union

from autopar.placements import Placement, parse_placement
from autopar.plan import Plan
from autopar.solver.ilp import solve_ilp
from autopar.solver.problem import ilp_problem
from autopar.solver.search import SearchResult


def _ms(s: float) -> str:
    return f"{s * 1e3:+.3f} ms" if math.isfinite(s) else "infinite (a needed resharding is not allowed)"


def _local_delta(tab, choice: dict, key: str, alt: int) -> tuple[float, list[str]]:
    chosen = choice[key]
    c0, c1 = tab.costs[key][chosen], tab.costs[key][alt]
    w = tab.weight[key]
    lines = []
    d_node = w * (c1.total_s - c0.total_s)
    if d_node:
        lines.append(f"  the op itself: {_ms(d_node)} (compute {_ms(w * (c1.fwd_s + c1.bwd_s - c0.fwd_s - c0.bwd_s))})")
    total = d_node
    for e in tab.edges:
        if key not in (e.u, e.v):
            continue
        m = tab.edge_costs(e)
        a0, b0 = choice[e.u], choice[e.v]
        a1, b1 = (alt, b0) if e.u == key else (a0, alt)
        before, after = m[a0][b0], m[a1][b1]
        d = e.weight * (after.total_s - before.total_s)
        if d:
            other = e.v if e.u == key else e.u
            kinds = "/".join(k for k in (after.fwd_kind, after.bwd_kind) if k) or "none"
            lines.append(f"  edge {'to' if e.u == key else 'from'} {other}: {_ms(d)} (now {kinds})")
        total += d
    return total, lines


def explain(result: Union[SearchResult, Plan], key: str, placement: Union[str, Placement]) -> str:
    """Cost of giving ``key`` the tp-axis output ``placement`` ("S(0)", "R", "P", or a strategy name
    such as "colwise") instead of the chosen one."""
    if isinstance(result, Plan):
        st = result.strategy(key)
        return (f"{key}: chosen {st.name} ({st}). Costs of alternatives need the solver's tables: call "
                f"autopar.solver.solve(...) (same arguments as plan_model) and pass its result to explain().")
    tab, choice = result.solution.tables, result.solution.choice
    if key not in tab.strategies:
        raise KeyError(f"no node {key!r} in the plan; keys look like {next(iter(tab.keys))!r}")
    strats = tab.strategies[key]
    chosen = strats[choice[key]]
    by_name = [i for i, s in enumerate(strats) if s.name == placement]
    if by_name:
        wanted, label = by_name, str(placement)
    else:
        p = parse_placement(placement) if isinstance(placement, str) else placement
        wanted, label = [i for i, s in enumerate(strats) if s.output == p], str(p)
    head = f"{key}: chosen {chosen} (tp={tab.t}, micro-batch {tab.mbs})"
    if not wanted:
        avail = ", ".join(sorted({f"{s.output} ({s.name})" for s in strats}))
        return (f"{head}.\n{label} is not a strategy here: shards must divide the dim by tp={tab.t}"
                f"{'' if tab.sp else ', sequence shards need sequence parallelism on'}. Available: {avail}.")
    if choice[key] in wanted:
        return f"{head}.\n{label} is what the plan chose."
    best_alt, best_d, best_lines = None, math.inf, []
    for i in wanted:
        d, lines = _local_delta(tab, choice, key, i)
        if best_alt is None or d < best_d:
            best_alt, best_d, best_lines = i, d, lines
    alt = strats[best_alt]
    out = [head + ".", f"Alternative {alt}: {_ms(best_d)} per micro-batch with every other node as chosen:"]
    out += best_lines
    dm = tab.weight[key] * (tab.costs[key][best_alt].saved_bytes - tab.costs[key][choice[key]].saved_bytes
                            + 2 * (tab.costs[key][best_alt].param_numel - tab.costs[key][choice[key]].param_numel))
    if dm:
        out.append(f"  memory: {dm / 1e6:+.1f} MB of activations/params per micro-batch")
    # global: pin and re-solve
    problem = ilp_problem(tab)
    idx = tab.keys.index(key)
    costs = list(problem.node_costs)
    costs[idx] = tuple(c if s in wanted else math.inf for s, c in enumerate(costs[idx]))
    r = solve_ilp(replace(problem, node_costs=tuple(costs)))
    if r.status == "optimal":
        base = problem.objective(tuple(choice[k] for k in tab.keys))
        changed = sum(1 for j, k in enumerate(tab.keys) if r.choice[j] != choice[k])
        out.append(f"Re-optimizing everything else with {key} pinned to {label}: {_ms(r.objective - base)} "
                   f"per micro-batch ({changed - 1} other nodes change strategy); x{result.plan.num_micro_batches} "
                   f"micro-batches per step.")
    else:
        out.append(f"Pinning {key} to {label} leaves no feasible plan for the other nodes.")
    return "\n".join(out)
