"""The strategy-selection ILP (math in ``autopar/solver/__init__.py``), solved with pulp.

``IlpProblem`` is plain data: per node a cost per strategy, per edge a cost matrix (``inf``
forbids a pair), optional linear memory constraints over the node choices. It knows nothing of
graphs or hardware (``problem.py`` builds it), so it can be tested against ``brute_force`` on
random instances. Each constraint family is one function below. Solver: HiGHS through
``pulp.HiGHS`` when available, else CBC; ``IlpResult.solver`` says which ran.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import pulp

OBJ_SCALE = 1e3     # seconds -> milliseconds inside the solver (better conditioned)
INTEGRAL_TOL = 1e-6  # a relaxed strategy variable this close to 0 or 1 counts as integral


@dataclass(frozen=True)
class IlpEdge:
    u: int
    v: int
    costs: tuple[tuple[float, ...], ...]      # [strategy of u][strategy of v]; math.inf forbids


@dataclass(frozen=True)
class LinearConstraint:
    """sum over nodes of coeffs[node][chosen strategy] <= rhs."""
    name: str
    coeffs: tuple[tuple[float, ...], ...]
    rhs: float


@dataclass(frozen=True)
class IlpProblem:
    names: tuple[str, ...]                          # node keys (for constraint names / errors)
    node_costs: tuple[tuple[float, ...], ...]       # [node][strategy], weighted by multiplicity
    edges: tuple[IlpEdge, ...]
    constraints: tuple[LinearConstraint, ...] = ()

    def objective(self, choice: tuple[int, ...]) -> float:
        return (sum(self.node_costs[v][s] for v, s in enumerate(choice))
                + sum(e.costs[choice[e.u]][choice[e.v]] for e in self.edges))

    def feasible(self, choice: tuple[int, ...]) -> bool:
        if any(math.isinf(e.costs[choice[e.u]][choice[e.v]]) for e in self.edges):
            return False
        return all(sum(c.coeffs[v][s] for v, s in enumerate(choice)) <= c.rhs * (1 + 1e-12) + 1e-9
                   for c in self.constraints)


@dataclass(frozen=True)
class IlpResult:
    choice: tuple[int, ...]       # chosen strategy index per node (empty when infeasible)
    objective: float              # recomputed exactly from ``choice`` (inf when infeasible)
    status: str                   # "optimal" | "infeasible"
    solver: str
    solve_time_s: float
    num_variables: int
    num_constraints: int
    violated: tuple[str, ...] = ()  # names of constraint families that made it infeasible


# ---- size reduction ---------------------------------------------------------------------------

def merge_parallel_edges(problem: IlpProblem) -> IlpProblem:
    """Sum the cost matrices of edges between the same (u, v) pair; drop self-loops into nodes."""
    merged: dict[tuple[int, int], list[list[float]]] = {}
    for e in problem.edges:
        if e.u == e.v:
            raise ValueError(f"edge from node {problem.names[e.u]!r} to itself")
        key = (e.u, e.v)
        if key in merged:
            acc = merged[key]
            for a, row in enumerate(e.costs):
                for b, c in enumerate(row):
                    acc[a][b] += c
        else:
            merged[key] = [list(r) for r in e.costs]
    edges = tuple(IlpEdge(u, v, tuple(tuple(r) for r in m)) for (u, v), m in merged.items())
    return replace(problem, edges=edges)


def prune_dominated(problem: IlpProblem) -> tuple[IlpProblem, tuple[tuple[int, ...], ...]]:
    """Drop strategies that another strategy of the same node beats or ties everywhere (its node
    cost, every incident edge row/column and every constraint coefficient are <=). Replacing a
    dominated choice by its dominator never raises the objective nor breaks a constraint, so the
    optimum is kept. Returns the reduced problem and, per node, the kept original indices."""
    n = len(problem.node_costs)
    keep = [list(range(len(c))) for c in problem.node_costs]
    incident: list[list[tuple[IlpEdge, bool]]] = [[] for _ in range(n)]
    for e in problem.edges:
        incident[e.u].append((e, True))
        incident[e.v].append((e, False))

    def vector(v: int, s: int) -> list[float]:
        vec = [problem.node_costs[v][s]]
        vec += [c.coeffs[v][s] for c in problem.constraints]
        for e, is_u in incident[v]:
            if is_u:
                vec += [e.costs[s][b] for b in keep[e.v]]
            else:
                vec += [e.costs[a][s] for a in keep[e.u]]
        return vec

    changed = True
    while changed:
        changed = False
        for v in range(n):
            if len(keep[v]) < 2:
                continue
            vecs = {s: vector(v, s) for s in keep[v]}
            survivors = []
            for s in keep[v]:
                dominated = False
                for o in keep[v]:
                    if o == s or o not in vecs:
                        continue
                    a, b = vecs[o], vecs[s]
                    if all(x <= y for x, y in zip(a, b)) and (o < s or any(x < y for x, y in zip(a, b))):
                        dominated = True
                        break
                if dominated:
                    del vecs[s]
                else:
                    survivors.append(s)
            if len(survivors) < len(keep[v]):
                keep[v] = survivors
                changed = True
    kept = tuple(tuple(k) for k in keep)
    reduced = IlpProblem(
        names=problem.names,
        node_costs=tuple(tuple(problem.node_costs[v][s] for s in kept[v]) for v in range(n)),
        edges=tuple(IlpEdge(e.u, e.v, tuple(tuple(e.costs[a][b] for b in kept[e.v]) for a in kept[e.u]))
                    for e in problem.edges),
        constraints=tuple(LinearConstraint(c.name, tuple(tuple(c.coeffs[v][s] for s in kept[v]) for v in range(n)),
                                           c.rhs) for c in problem.constraints))
    return reduced, kept


@dataclass
class _Reduction:
    """Exact eliminations done before the ILP; replayed backwards to recover the choices."""
    log: list
    problem: IlpProblem            # the remaining problem (nodes renumbered)
    remaining: tuple[int, ...]     # original index of each remaining node


def eliminate(problem: IlpProblem) -> _Reduction:
    """Leaf and series elimination (exact for pairwise costs). A node is eliminable when every
    constraint gives it the same coefficient whatever its strategy (the constant moves to the
    right-hand side). A leaf v with one neighbour u folds ``min_sv c_v + c_uv`` into u's costs;
    a node with two neighbours a, b becomes an edge (a, b) with ``min_sv c_v + c_av + c_vb``;
    an isolated node takes its cheapest strategy. Repeats until nothing is eliminable."""
    n = len(problem.node_costs)
    cost = {v: list(problem.node_costs[v]) for v in range(n)}
    adj: dict[int, dict[int, list[list[float]]]] = {v: {} for v in range(n)}   # adj[v][u][sv][su]
    for e in problem.edges:
        m = [list(r) for r in e.costs]
        if e.v in adj[e.u]:
            acc = adj[e.u][e.v]
            for a in range(len(m)):
                for b in range(len(m[a])):
                    acc[a][b] += m[a][b]
        else:
            adj[e.u][e.v] = m
        adj[e.v][e.u] = [list(col) for col in zip(*adj[e.u][e.v])]
    rhs = [c.rhs for c in problem.constraints]

    def constant(v: int) -> Optional[list[float]]:
        consts = []
        for c in problem.constraints:
            row = c.coeffs[v]
            if any(x != row[0] for x in row):
                return None
            consts.append(row[0])
        return consts

    def remove(v: int, consts: list[float]) -> None:
        for i, k in enumerate(consts):
            rhs[i] -= k
        for u in adj[v]:
            del adj[u][v]
        del adj[v]
        del cost[v]

    log: list = []
    changed = True
    while changed:
        changed = False
        for v in list(cost):
            if v not in cost or len(adj[v]) > 2:
                continue
            consts = constant(v)
            if consts is None:
                continue
            nbrs = list(adj[v])
            cv = cost[v]
            if not nbrs:
                s = min(range(len(cv)), key=lambda i: cv[i])
                log.append(("isolated", v, s))
            elif len(nbrs) == 1:
                u = nbrs[0]
                m = adj[v][u]                                   # [sv][su]
                arg = []
                for su in range(len(cost[u])):
                    best = min(range(len(cv)), key=lambda sv: cv[sv] + m[sv][su])
                    arg.append(best)
                    cost[u][su] += cv[best] + m[best][su]
                log.append(("leaf", v, u, arg))
            else:
                a, b = nbrs
                ma, mb = adj[v][a], adj[v][b]                   # [sv][sa], [sv][sb]
                new = [[0.0] * len(cost[b]) for _ in cost[a]]
                arg = [[0] * len(cost[b]) for _ in cost[a]]
                for sa in range(len(cost[a])):
                    for sb in range(len(cost[b])):
                        best = min(range(len(cv)), key=lambda sv: cv[sv] + ma[sv][sa] + mb[sv][sb])
                        arg[sa][sb] = best
                        new[sa][sb] = cv[best] + ma[best][sa] + mb[best][sb]
                if b in adj[a]:
                    acc = adj[a][b]
                    for sa in range(len(new)):
                        for sb in range(len(new[sa])):
                            acc[sa][sb] += new[sa][sb]
                else:
                    adj[a][b] = new
                adj[b][a] = [list(col) for col in zip(*adj[a][b])]
                log.append(("series", v, a, b, arg))
            remove(v, consts)
            changed = True
    remaining = tuple(sorted(cost))
    index = {v: i for i, v in enumerate(remaining)}
    edges = []
    for v in remaining:
        for u, m in adj[v].items():
            if v < u:
                edges.append(IlpEdge(index[v], index[u], tuple(tuple(r) for r in m)))
    reduced = IlpProblem(tuple(problem.names[v] for v in remaining), tuple(tuple(cost[v]) for v in remaining),
                         tuple(edges),
                         tuple(LinearConstraint(c.name, tuple(c.coeffs[v] for v in remaining), rhs[i])
                               for i, c in enumerate(problem.constraints)))
    return _Reduction(log, reduced, remaining)


def _replay(red: _Reduction, partial: dict[int, int]) -> dict[int, int]:
    choice = dict(partial)
    for entry in reversed(red.log):
        if entry[0] == "isolated":
            choice[entry[1]] = entry[2]
        elif entry[0] == "leaf":
            _, v, u, arg = entry
            choice[v] = arg[choice[u]]
        else:
            _, v, a, b, arg = entry
            choice[v] = arg[choice[a]][choice[b]]
    return choice


# ---- constraint families -----------------------------------------------------------------------

def add_one_strategy(model: pulp.LpProblem, x, problem: IlpProblem) -> None:
    """(a) sum_s x[v,s] = 1 for every node v."""
    for v, xs in enumerate(x):
        model += _expr((var, 1.0) for var in xs) == 1, f"one_strategy[{problem.names[v]}]"


def add_edge_consistency(model: pulp.LpProblem, x, y, problem: IlpProblem) -> None:
    """(b) y[e,a,b] is the product x[u,a] x[v,b], linearized exactly by its two marginals:
    sum_b y[e,a,b] = x[u,a] and sum_a y[e,a,b] = x[v,b]. Forbidden pairs (inf) have no y."""
    for i, e in enumerate(problem.edges):
        ye = y[i]
        name = f"{problem.names[e.u]}->{problem.names[e.v]}"
        for a, xa in enumerate(x[e.u]):
            model += _expr([(ye[(a, b)], 1.0) for b in range(len(x[e.v])) if (a, b) in ye] + [(xa, -1.0)]) == 0, \
                f"edge_out[{name},{a}]"
        for b, xb in enumerate(x[e.v]):
            model += _expr([(ye[(a, b)], 1.0) for a in range(len(x[e.u])) if (a, b) in ye] + [(xb, -1.0)]) == 0, \
                f"edge_in[{name},{b}]"


def add_memory(model: pulp.LpProblem, x, problem: IlpProblem) -> None:
    """(c) sum_{v,s} mem[v,s] x[v,s] <= budget, one per constraint (e.g. per pipeline stage).
    Each row is divided by its largest magnitude so the solver's tolerances are relative."""
    for c in problem.constraints:
        scale = max([abs(c.rhs)] + [abs(a) for row in c.coeffs for a in row]) or 1.0
        model += _expr((x[v][s], c.coeffs[v][s] / scale)
                       for v in range(len(x)) for s in range(len(x[v])) if c.coeffs[v][s]) \
            <= c.rhs / scale, f"memory_budget[{c.name}]"


def objective(x, y, problem: IlpProblem):
    """min sum_{v,s} c[v,s] x[v,s] + sum_{e,a,b} r[e,a,b] y[e,a,b]."""
    terms = [(x[v][s], problem.node_costs[v][s] * OBJ_SCALE)
             for v in range(len(x)) for s in range(len(x[v]))
             if problem.node_costs[v][s] and not math.isinf(problem.node_costs[v][s])]
    for i, e in enumerate(problem.edges):
        terms += [(var, e.costs[a][b] * OBJ_SCALE) for (a, b), var in y[i].items() if e.costs[a][b]]
    return _expr(terms)


def _expr(terms) -> pulp.LpAffineExpression:
    """sum of coefficient x variable over ``terms`` ((variable, coefficient) pairs, each variable
    once): pulp's expression built from the pairs directly (``lpSum`` of products builds an
    expression per term, most of the model's build time on these problems)."""
    return pulp.LpAffineExpression(list(terms))


# ---- solving ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _quiet_highs_banner() -> None:
    """highspy prints a copyright banner on stdout when the process builds its first Highs object
    (``msg=False`` cannot stop it); build that first one with fd 1 on /dev/null."""
    import highspy
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solver(mip: bool = True) -> tuple[pulp.LpSolver, str]:
    """HiGHS (else CBC), exact; ``mip=False``: the LP relaxation (integer variables relaxed)."""
    # one thread: these MIPs are small (hundreds of variables) and solved by the hundred. HiGHS's
    # worker threads gain nothing on them (LLaMA-3 8B's 1M-token search, 102 solves: the same time
    # on a quiet 2-core machine, the same optima) and spin beside other work on a loaded one
    highs = pulp.HiGHS(mip=mip, msg=False, gapRel=0.0, gapAbs=0.0, threads=1)
    if highs.available():
        _quiet_highs_banner()
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(mip=mip, msg=False, gapRel=0.0, gapAbs=0.0), "CBC"


def _integral(x) -> bool:
    """Whether every strategy variable of a solved model is 0 or 1 (within ``INTEGRAL_TOL``)."""
    return all(min(abs(v), abs(1.0 - v)) <= INTEGRAL_TOL for xs in x for v in (var.value() or 0.0 for var in xs))


def solver_name() -> str:
    return _solver()[1]


def solve_ilp(problem: IlpProblem, prune: bool = True) -> IlpResult:
    """Solve exactly (gap 0): merge parallel edges, drop dominated strategies, eliminate leaves and
    series nodes, give the rest to the MILP solver, replay the eliminations. The objective is
    recomputed from the chosen strategies on the original problem. ``num_variables`` /
    ``num_constraints`` are those of the MILP actually solved (0 when eliminations left nothing)."""
    t0 = time.perf_counter()
    merged = merge_parallel_edges(problem)
    reduced, kept = prune_dominated(merged) if prune else (merged, tuple(tuple(range(len(c))) for c in merged.node_costs))
    red = eliminate(reduced) if prune else _Reduction([], reduced, tuple(range(len(reduced.node_costs))))
    rest = red.problem
    name = solver_name()
    n_vars = n_cons = 0
    partial: dict[int, int] = {}
    if rest.node_costs:
        model = pulp.LpProblem("autopar_strategies", pulp.LpMinimize)
        # a strategy whose folded cost is infinite (every completion forbidden) is fixed to 0
        # (pulp's "Binary" resets bounds to [0, 1], hence Integer with explicit bounds)
        x = [[model.add_variable(f"x_{v}_{s}", 0, 0 if math.isinf(c[s]) else 1, cat="Integer") for s in range(len(c))]
             for v, c in enumerate(rest.node_costs)]
        y = []
        for i, e in enumerate(rest.edges):
            y.append({(a, b): model.add_variable(f"y_{i}_{a}_{b}", 0, None)
                      for a in range(len(e.costs)) for b in range(len(e.costs[a])) if not math.isinf(e.costs[a][b])})
        model += objective(x, y, rest)
        add_one_strategy(model, x, rest)
        add_edge_consistency(model, x, y, rest)
        add_memory(model, x, rest)
        # Without memory rows, the LP relaxation first: the edge marginals make it exact on trees,
        # and on these graphs' cycles it came out integral every time (LLaMA-3 8B on 64 H100s: all
        # 85 unconstrained solves; 2 of its 37 memory-constrained ones). An integral LP optimum is
        # a MIP optimum (the relaxation's optimum bounds the MIP's from below and is feasible for
        # it), at a fifth of the MIP's time; a fractional one falls through to the MIP.
        for mip in ((True,) if rest.constraints else (False, True)):
            solver, name = _solver(mip)
            model.solve(solver)
            if pulp.LpStatus[model.status] != "Optimal" or not mip and _integral(x):
                break
        n_vars = sum(len(r) for r in x) + sum(len(d) for d in y)
        n_cons = model.numConstraints()
        if pulp.LpStatus[model.status] != "Optimal":          # the relaxation infeasible: the MIP too
            return _infeasible(problem, name, t0, n_vars, n_cons)
        for i, xs in enumerate(x):
            partial[red.remaining[i]] = max(range(len(xs)), key=lambda j: xs[j].value() or 0.0)
    elif any(c.rhs < -1e-9 for c in rest.constraints):
        return _infeasible(problem, name, t0, 0, 0)
    local = _replay(red, partial)
    choice = tuple(kept[v][local[v]] for v in range(len(kept)))
    obj = problem.objective(choice)
    if math.isinf(obj) or not problem.feasible(choice):
        return _infeasible(problem, name, t0, n_vars, n_cons)
    return IlpResult(choice, obj, "optimal", name, time.perf_counter() - t0, n_vars, n_cons)


def _infeasible(problem: IlpProblem, name: str, t0: float, n_vars: int, n_cons: int) -> IlpResult:
    violated = tuple(f"memory_budget[{c.name}]" for c in problem.constraints) or ("edge_consistency",)
    return IlpResult((), math.inf, "infeasible", name, time.perf_counter() - t0, n_vars, n_cons, violated)


def brute_force(problem: IlpProblem, limit: int = 2_000_000) -> IlpResult:
    """Enumerate every assignment (small problems only: at most ``limit`` of them)."""
    t0 = time.perf_counter()
    sizes = [len(c) for c in problem.node_costs]
    total = math.prod(sizes)
    if total > limit:
        raise ValueError(f"brute force over {total} assignments exceeds limit {limit}")
    best: Optional[tuple[int, ...]] = None
    best_obj = math.inf
    for choice in itertools.product(*(range(s) for s in sizes)):
        if not problem.feasible(choice):
            continue
        obj = problem.objective(choice)
        if obj < best_obj:
            best, best_obj = choice, obj
    if best is None:
        return IlpResult((), math.inf, "infeasible", "brute-force", time.perf_counter() - t0, total, 0)
    return IlpResult(best, best_obj, "optimal", "brute-force", time.perf_counter() - t0, total, 0)
