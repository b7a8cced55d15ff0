"""The strategy ILP against brute force on small random problems (exact objective match)."""
import math

from hypothesis import given, settings, strategies as st

from autopar.solver.ilp import IlpEdge, IlpProblem, LinearConstraint, brute_force, prune_dominated, solve_ilp


@st.composite
def random_problems(draw, with_memory=False):
    n = draw(st.integers(2, 6))
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    cost = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    node_costs = tuple(tuple(draw(cost) for _ in range(k)) for k in sizes)
    chain = draw(st.booleans())
    pairs = [(i, i + 1) for i in range(n - 1)] if chain else \
        sorted(set(draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), min_size=1, max_size=8))))
    edges = []
    for u, v in pairs:
        if u >= v:
            continue
        costs = tuple(tuple(math.inf if draw(st.integers(0, 9)) == 0 else draw(cost) for _ in range(sizes[v]))
                      for _ in range(sizes[u]))
        edges.append(IlpEdge(u, v, costs))
    constraints = ()
    if with_memory:
        mem = st.integers(0, 20).map(lambda i: i / 4)  # no tolerance-borderline instances
        coeffs = tuple(tuple(draw(mem) for _ in range(k)) for k in sizes)
        constraints = (LinearConstraint("stage0", coeffs, draw(st.integers(0, 20 * n).map(lambda i: i / 4))),)
    return IlpProblem(tuple(f"n{i}" for i in range(n)), node_costs, tuple(edges), constraints)


def _check(p):
    bf = brute_force(p)
    for prune in (True, False):          # with and without dominance pruning + eliminations
        ilp = solve_ilp(p, prune=prune)
        assert ilp.status == bf.status
        if bf.status == "optimal":
            assert p.feasible(ilp.choice)
            assert abs(ilp.objective - bf.objective) <= 1e-9 * max(1.0, abs(bf.objective))


@settings(max_examples=40, deadline=None)
@given(random_problems())
def test_ilp_matches_brute_force(p):
    _check(p)


@settings(max_examples=25, deadline=None)
@given(random_problems(with_memory=True))
def test_ilp_matches_brute_force_with_memory(p):
    _check(p)


@settings(max_examples=30, deadline=None)
@given(random_problems(with_memory=True))
def test_pruning_keeps_the_optimum(p):
    reduced, kept = prune_dominated(p)
    full, red = brute_force(p), brute_force(reduced)
    assert full.status == red.status
    if full.status == "optimal":
        assert abs(full.objective - red.objective) <= 1e-9 * max(1.0, abs(full.objective))


def test_infeasible_memory_is_reported():
    p = IlpProblem(("a", "b"), ((1.0, 2.0), (1.0,)), (IlpEdge(0, 1, ((0.0,), (0.0,))),),
                   (LinearConstraint("stage0", ((5.0, 6.0), (1.0,)), 2.0),))
    r = solve_ilp(p)
    assert r.status == "infeasible" and r.violated == ("memory_budget[stage0]",)
    assert brute_force(p).status == "infeasible"


def test_fractional_relaxation_falls_back_to_the_mip():
    """Unconstrained problems are solved as LP relaxations first (``solve_ilp``); on an odd
    frustrated cycle the relaxation is fractional (every x = 1/2, the edge marginals all on unequal
    pairs, objective 0), and only the MIP gives the optimum: K4 with two strategies per node, a
    cost of 1 where an edge's ends choose alike, colours two nodes each way: 2 such edges."""
    same = ((1.0, 0.0), (0.0, 1.0))
    edges = tuple(IlpEdge(u, v, same) for u in range(4) for v in range(u + 1, 4))
    p = IlpProblem(tuple(f"n{i}" for i in range(4)), ((0.0, 0.0),) * 4, edges)
    for prune in (True, False):
        r = solve_ilp(p, prune=prune)
        assert r.status == "optimal" and r.objective == brute_force(p).objective == 2.0
