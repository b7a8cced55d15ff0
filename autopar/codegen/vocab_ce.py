"""Vocab-parallel cross-entropy: the executor's path for logits sharded on the class dim over the
TENSOR axis (``autopar.mesh.TENSOR``, found in the DeviceMesh by name).

``vocab_parallel_ce`` says whether a ``aten.cross_entropy_loss`` call qualifies (class-sharded
logits, integer targets, no class weight, no label smoothing); ``VocabParallelCE`` runs it through
``torch.distributed.tensor.parallel.loss_parallel`` per row and reduces as aten does (see its
docstring for the collectives; ``expected.py`` predicts the same).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial as TPartial, Replicate as TReplicate, Shard as TShard

from autopar.mesh import TENSOR, axis_position

VOCAB_CE_TARGET = "aten.cross_entropy_loss.default"


def ce_arg(args, kwargs, i: int, name: str, default):
    return args[i] if i < len(args) else kwargs.get(name, default)


def tensor_axis(mesh) -> Optional[int]:
    """Position of the TENSOR axis in a DeviceMesh (by name; None: the mesh has none)."""
    return axis_position(mesh.mesh_dim_names, TENSOR)


def class_sharded_on_tp(x, mesh) -> bool:
    """Logits Shard(class dim 1) on the TENSOR axis (size > 1); every other axis Shard(another dim)
    or Replicate."""
    t = tensor_axis(mesh)
    if not isinstance(x, DTensor) or x.ndim < 2 or t is None or mesh.size(t) == 1:
        return False
    pl = x.placements
    if not (isinstance(pl[t], TShard) and pl[t].dim % x.ndim == 1):
        return False
    return all(isinstance(q, TReplicate) or (isinstance(q, TShard) and q.dim % x.ndim != 1)
               for i, q in enumerate(pl) if i != t)


def vocab_parallel_ce(args, kwargs, mesh) -> bool:
    """Whether ``aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index,
    label_smoothing)`` runs vocab-parallel (``loss_parallel``): logits class-sharded on tp, integer
    class targets, no class weight, no label smoothing."""
    tgt = args[1] if len(args) > 1 else kwargs.get("target")
    return (class_sharded_on_tp(args[0], mesh) and isinstance(tgt, torch.Tensor)
            and not tgt.is_floating_point() and ce_arg(args, kwargs, 2, "weight", None) is None
            and float(ce_arg(args, kwargs, 5, "label_smoothing", 0.0)) == 0.0)


def _ce_target_placements(x: DTensor) -> tuple:
    """loss_parallel's target placements: the logits' with the TENSOR-axis class shard Replicate
    and shards of later dims shifted down by one (the class dim is gone)."""
    t = tensor_axis(x.device_mesh)
    out = []
    for i, q in enumerate(x.placements):
        if i == t:
            out.append(TReplicate())
        elif isinstance(q, TShard):
            d = q.dim % x.ndim
            out.append(TShard(d - 1 if d > 1 else d))
        else:
            out.append(q)
    return tuple(out)


class VocabParallelCE(torch.autograd.Function):
    """Cross-entropy on class-sharded logits under ``loss_parallel()``, per row
    (``reduction='none'``: loss_parallel's mean needs a 1-D mesh), then reduced here as aten does:
    mean = sum of the per-row losses / the number of targets != ignore_index (weight None).

    Forward collectives, on the TENSOR axis, of (local rows, 1) fp32-or-logits-dtype tensors: all_reduce MAX of
    the row max, all_reduce SUM of the row sum-exp (both in the computation dtype, fp32 for
    fp32/bf16/fp16 logits), all_reduce SUM of the target logit (logits dtype). On each other axis
    that shards the rows (the DATA axis), mean: all_reduce of the local target count (4 bytes, fp32). The
    result is Partial on those axes (each rank: its rows' sum / the global count), Replicate on
    the TENSOR axis.
    Backward: none (loss_parallel's fused nll + log_softmax backward is local).

    loss_parallel's backward handlers must be active when autograd runs the backward, which
    happens outside the executor: the per-row graph is built inside ``forward`` and differentiated
    in ``backward`` under ``loss_parallel()`` again."""

    @staticmethod
    def forward(ctx, x: DTensor, target: DTensor, reduction: int, ignore_index: int):
        from torch.distributed.tensor.parallel import loss_parallel
        import torch.distributed._functional_collectives as funcol

        mesh = x.device_mesh
        tpl = _ce_target_placements(x)
        if tuple(target.placements) != tpl:
            target = target.redistribute(mesh, tpl)
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            with loss_parallel():
                rows = torch.ops.aten.cross_entropy_loss.default(xd, target, None, 0, ignore_index, 0.0)
        ctx.graph = (xd, rows)
        ctx.reduction = reduction
        if reduction == 0:
            return rows.detach()
        sharded = [i for i, q in enumerate(tpl) if isinstance(q, TShard) and mesh.size(i) > 1]
        local = rows.to_local().detach()
        total = local.sum()
        if reduction == 1:
            count = (target.to_local() != ignore_index).sum().to(torch.float32)
            for i in sharded:
                count = funcol.wait_tensor(funcol.all_reduce(count, "sum", group=(mesh, i)))
            ctx.count = count
            total = (total.to(torch.float32) / count).to(local.dtype)
        out_pl = tuple(TPartial() if i in sharded else TReplicate() for i in range(mesh.ndim))
        return DTensor.from_local(total, mesh, out_pl, run_check=False, shape=torch.Size(()), stride=())

    @staticmethod
    def backward(ctx, g: DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        xd, rows = ctx.graph
        del ctx.graph
        mesh = rows.device_mesh
        if ctx.reduction == 0:
            if tuple(g.placements) != tuple(rows.placements):
                g = g.redistribute(mesh, rows.placements)
            grow = g
        else:
            rep = tuple(TReplicate() for _ in range(mesh.ndim))
            if tuple(g.placements) != rep:
                g = g.redistribute(mesh, rep)
            gl = g.to_local()
            if ctx.reduction == 1:
                gl = (gl.to(torch.float32) / ctx.count).to(gl.dtype)
            local = gl.expand(rows.to_local().shape).contiguous()
            grow = DTensor.from_local(local, mesh, rows.placements, run_check=False, shape=rows.shape,
                                      stride=rows.stride())
        with loss_parallel():
            (gx,) = torch.autograd.grad(rows, xd, grow)
        return gx, None, None, None
