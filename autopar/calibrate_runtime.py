"""The host's cost per graph node of an autopar training step, measured for ``autopar calibrate``.

A step runs each node of the traced graph through autopar's executor (forward), autograd
(backward) and the bookkeeping around them; on a CPU that host time is serial with the compute
and, for small models, larger than it. It is measured as a slope, so that what does not grow with
the graph (the loss all-reduce, the gradient bucket's collective, the optimizer's launch) cancels:
the same narrow GPT (hidden 16, 2 heads, vocabulary 64, 8 tokens: its arithmetic is negligible,
its op mix a transformer's) is trained at two depths under the running world's data parallelism,
and

    overhead per node = (step time(deep) - step time(shallow)) / (graph nodes(deep) - graph nodes(shallow))

once with plain tensors (``dp_mode="auto"``: what plans without tensor parallelism run) and once
with every op on DTensors (``dp_mode="dtensor"``: what tp > 1 runs). The cost model adds it to
every node (``GPUSpec.op_overhead_s`` / ``dtensor_op_overhead_s``, ``solver/problem.py``).
"""
from __future__ import annotations

import statistics
import time

SHALLOW, DEEP = 1, 4            # transformer layers (about 23 graph nodes each)
MODEL = "gpt:hidden=16,layers={layers},heads=2,vocab=64,seq=8"
WARMUP, TIMED = 2, 5            # steps per model


def _step_s_and_nodes(depth: int, world: int, dp_mode: str) -> tuple[float, int]:
    import torch

    from autopar.api import autoparallelize
    from autopar.models import build_model

    b = build_model(MODEL.format(layers=depth), batch=2 * world, device="meta")
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=f"dp={world}", dp_mode=dp_mode, record_collectives=False, timeout_s=120,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), model_name=f"calibrate-gpt{depth}")
    x, y = b.make_batch(2 * world, torch.Generator().manual_seed(0))
    for _ in range(WARMUP):
        pm.step(x, y)
    times = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        pm.step(x, y)
        times.append(time.perf_counter() - t0)
    nodes = sum(1 for n in pm._train_graph.nodes if n.kind == "op" and n.outputs)
    return statistics.median(times), nodes


def runtime_overheads(world: int) -> dict[str, float]:
    """{"plain": s, "dtensor": s} per graph node per step, on the running world (module docstring)."""
    out = {}
    for name, mode in (("plain", "auto"), ("dtensor", "dtensor")):
        t1, n1 = _step_s_and_nodes(SHALLOW, world, mode)
        t2, n2 = _step_s_and_nodes(DEEP, world, mode)
        out[name] = max(0.0, (t2 - t1) / (n2 - n1))
    return out
