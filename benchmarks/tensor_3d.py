"""The planner's 3-D tensor-parallel plan of gpt-tiny (tp = 8 as a 2 x 2 x 2 mesh; on 8 ranks the
2.5-D plan is the same one) trained on 8 gloo CPU ranks against one process, and each tensor axis'
traffic against the cost model's prediction (``codegen/expected.expected_collectives``).

    python benchmarks/tensor_3d.py [--steps 3] [--timeout 900]

About 20 s on 2 CPU cores, most of it the first step: every rank runs DTensor's sharding
propagation over three mesh axes (each op's strategies expanded over every axis). It took 354 s
while the plan split a linear along the sequence (a strided split inside DTensor, priced by a
shortest-path search per candidate), and finished no step in 10 minutes with a size-1 data axis in
the mesh. The plan is made for 8 GPUs whose links cost nothing, so that splitting gpt-tiny pays on
every axis, as in ``tests/runtime/test_tensor_axes_8rank.py`` (which trains it too); this script
prints the figures.

Prints the losses of both runs, the largest parameter difference after the last step (relative to
that parameter's largest entry), and per axis the bytes one rank issued per step against the
predicted bytes, with the collectives that differ. Exit status 1 when the numbers differ beyond
round-off (1e-4 relative; fp32 sums of <= 256 terms reordered move ~1e-6), else 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPEC, BATCH, WORLD = "gpt-tiny", 4, 8
RTOL = 1e-4


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _model():
    from autopar.models import build_model

    torch.manual_seed(0)
    return build_model(SPEC, device="cpu", batch=BATCH)


def _batches(b, steps: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [b.make_batch(BATCH, gen) for _ in range(steps)]


def _plan():
    from autopar.cost.hardware import LinkSpec, make_cluster
    from autopar.solver.forcing import parse_force
    from autopar.solver.search import plan_model
    from autopar.trace import trace_model

    b = _model()
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        collapse_repeats=False, model_name=SPEC)
    free = LinkSpec("free", busbw_Bps=1e15, latency_s=0.0, source="benchmark")
    cluster = dataclasses.replace(make_cluster("h100", 1, WORLD), intra=free, inter=free)
    seq = next(n.out.shape[1] for n in graph.nodes if n.kind == "input")
    plan = plan_model(graph, cluster, global_batch=BATCH, seq_len=seq, dtype="float32",
                      force=parse_force(f"tp=8,tpmode=3d,mbs={BATCH}"))
    return graph, plan


def _rank(rank: int, world: int, plan_json: dict, steps: int, timeout_s: float) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    b = _model()
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=_optimizer, plan=Plan.from_json(plan_json), seed=0, timeout_s=timeout_s)
    pm.reset_collectives()
    losses = [pm.step(x, y) for x, y in _batches(b, steps)]
    out = {"losses": losses, "issued": [c.key() for c in pm.collectives],
           "coords": dict(zip(pm.mesh.mesh_dim_names, pm.mesh.get_coordinate()))}
    sd = pm.full_state_dict()
    pm.close()
    if rank == 0:
        out["sd"] = sd
    return out


def _reference(steps: int) -> dict:
    b = _model()
    opt = _optimizer(b.module.parameters())
    losses = []
    for x, y in _batches(b, steps):
        opt.zero_grad(set_to_none=True)
        loss = b.loss_fn(b.module(*x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "sd": {k: v.detach() for k, v in b.module.named_parameters(remove_duplicate=False)}}


def _by_axis(keys) -> Counter:
    """Bytes per axis of collective keys (kind, axis, bytes, phase)."""
    out: Counter = Counter()
    for _, axis, nbytes, _ in keys:
        out[axis] += nbytes
    return out


def main(argv=None) -> int:
    from autopar.codegen.expected import expected_collectives
    from autopar.runtime.launch import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="the process groups' timeout, seconds")
    args = ap.parse_args(argv)
    graph, plan = _plan()
    print(f"plan: mesh {dict(zip(plan.mesh_axes, plan.mesh_shape))}, {plan.summary()['tensor_parallel_mode']}")
    t0 = time.perf_counter()
    runs = spawn_ranks(_rank, WORLD, (plan.to_json(), args.steps, args.timeout), timeout_s=args.timeout)
    wall = time.perf_counter() - t0
    ref = _reference(args.steps)
    print(f"8 ranks, {args.steps} steps: {wall:.0f} s")
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], ref["losses"]))
    print("losses  ", [f"{x:.6f}" for x in runs[0]["losses"]], "\nref     ", [f"{x:.6f}" for x in ref["losses"]])
    sd = runs[0]["sd"]
    worst_param, where = max(((sd[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-12), k)
                             for k, v in ref["sd"].items())
    print(f"largest relative loss difference {worst_loss:.2e}; parameter {worst_param:.2e} ({where})")
    differ = 0
    print(f"{'rank':>4} {'coords':<22} " + " ".join(f"{a + ' issued/predicted':>28}" for a in plan.mesh_axes))
    for r, run in enumerate(runs):
        want = Counter({k: n * args.steps for k, n in
                        Counter(c.key() for c in expected_collectives(graph, plan, tp_rank=run["coords"])).items()})
        got = Counter(run["issued"])
        issued, predicted = _by_axis(got.elements()), _by_axis(want.elements())
        print(f"{r:>4} {str(run['coords']):<22} " + " ".join(
            f"{issued[a] // args.steps:>13,} / {predicted[a] // args.steps:<12,}" for a in plan.mesh_axes))
        if got != want:
            differ += 1
            if differ == 1:
                print(f"     issued, not predicted: {dict(got - want)}\n     predicted, not issued: {dict(want - got)}")
    print(f"collectives as predicted on {WORLD - differ} of {WORLD} ranks")
    return 0 if worst_loss <= RTOL and worst_param <= RTOL else 1


if __name__ == "__main__":
    sys.exit(main())
