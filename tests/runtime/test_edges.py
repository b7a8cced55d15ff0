"""Edges deliver a Partial value contiguous (``codegen/edges._partial_contiguous``), and an op's
output that DTensor left masked-Partial is a plain Partial (``codegen/edges.unmasked``).

A linear over the channels of a conv activation reads a ``movedim`` view (channels-last, not
contiguous). Planned Partial on tp (a linear of a Partial input is Partial), it reached the linear
as that view, whose reshape cloned it, and DTensor's clone strategy all-reduced it to Replicate:
an all-reduce the plan did not have (found by ``benchmarks/fuzz.py --seed 33 --predictions``, a
conv2d model at tp=4; the numbers were right). On 2 gloo ranks: the edge into the Partial input,
and a Partial view passed on as it is, each run the linear with no collective, Partial out, and
the value summed over the ranks is one process' linear.

A vocab-sharded embedding lookup is masked-Partial: each rank looked up its slice of the rows, the
others masked when the value is reduced, the mask then released. A plan that reduces the lookup
twice (an RMS norm's reduce-scatter and its scale's, ``benchmarks/fuzz.py --seed 36``, tp=4)
found the mask gone at the second: an AssertionError inside torch. Unmasked where it is made, it
reduces any number of times, and the table's gradient is one process'."""
from __future__ import annotations

import pytest

from autopar.runtime.launch import spawn_ranks


def _linear_after_edge(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.codegen.edges import edge

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 4, generator=gen).movedim(1, -1)         # (2, 4, 4, 3), a view
    w = torch.randn(5, 3, generator=gen)
    want = F.linear(x, w)
    W = DTensor.from_local(w, mesh, [Replicate()], run_check=False)
    out = {}
    for case in ("replicate in", "partial view in"):
        if case == "replicate in":          # the edge makes it Partial (each rank 1/n of it)
            v = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        else:                               # already Partial, a view: the edge passes it on
            part = x.movedim(-1, 1).contiguous() / world
            v = DTensor.from_local(part, mesh, [Partial()], run_check=False).movedim(1, -1)
        assert not v.to_local().is_contiguous()
        with CommDebugMode() as comm:
            y = F.linear(edge(v, (Partial(),)), W)
        out[case] = (y.placements[0].is_partial(), comm.get_total_counts(),
                     float((y.full_tensor() - want).abs().max()))
    return out


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_linear_after_edge, 2, (), timeout_s=60)


@pytest.mark.parametrize("case", ["replicate in", "partial view in"])
def test_a_partial_view_reaches_a_linear_without_a_collective(case, results):
    for r in results:
        partial, collectives, err = r[case]
        assert partial and collectives == 0, r[case]
        assert err <= 1e-6, r[case]


def _lookup_reduced_twice(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.codegen.edges import unmasked

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 4, generator=gen)
    idx = torch.tensor([[0, 5, 2, 3], [4, 1, 1, 0]])
    ca, cb = torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    ref_w = table.clone().requires_grad_()
    ref = F.embedding(idx, ref_w)
    ((ref * ca).sum() + (ref * cb).sum()).backward()
    W = DTensor.from_local(table.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False).requires_grad_()
    y = F.embedding(DTensor.from_local(idx, mesh, [Replicate()], run_check=False), W)
    out = {"masked": type(y.placements[0]).__name__}
    z = unmasked(y)
    a, b = z.redistribute(mesh, [Replicate()]), z.redistribute(mesh, [Shard(1)])
    ((a.to_local() * ca).sum() + (b.full_tensor() * cb).sum()).backward()
    out.update(plain=z.placements[0].is_partial() and type(z.placements[0]).__name__,
               value=float((a.full_tensor() - ref.detach()).abs().max()),
               grad=float((W.grad.full_tensor() - ref_w.grad).abs().max()))
    return out


def test_a_masked_lookup_reduces_twice():
    for r in spawn_ranks(_lookup_reduced_twice, 2, (), timeout_s=60):
        assert r["masked"] != "Partial" and r["plain"] == "Partial", r     # DTensor's mask, then a plain one
        assert r["value"] <= 1e-6 and r["grad"] <= 1e-6, r
