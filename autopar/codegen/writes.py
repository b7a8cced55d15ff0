"""In-place writes of the exported training graph (BatchNorm running statistics, counters,
caches): which operands an op writes, through which views, and whether two tensors share memory.
The executor uses them so every write happens exactly once per run, as in one process."""
from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import DTensor


_aten = torch.ops.aten
# composite ops that update running statistics in training mode although their schema marks no
# argument as written: (positions of running_mean, running_var), position of the training flag
_RUNNING_STATS = {_aten.batch_norm.default: ((3, 4), 5), _aten.instance_norm.default: ((3, 4), 5)}


def written_args(node: fx.Node) -> tuple[int, ...]:
    """Positions of ``node.args`` the op writes in place: the schema's ``Tensor(a!)`` arguments,
    and the running statistics of batch / instance norm in training mode."""
    return written_positions(node.target, node.args)


def written_positions(op, args) -> tuple[int, ...]:
    """``written_args`` of a call of ``op`` with positional ``args``."""
    if not isinstance(op, torch._ops.OpOverload):
        return ()
    if op in _RUNNING_STATS:
        pos, flag = _RUNNING_STATS[op]
        return pos if len(args) > flag and args[flag] is True else ()
    return tuple(i for i, a in enumerate(op._schema.arguments)
                 if i < len(args) and a.alias_info is not None and a.alias_info.is_write)


def probe_copies(op, args) -> tuple:
    """``args`` with the operands ``op`` writes in place copied, for a probe that must not write."""
    written = written_positions(op, args)
    return tuple(a.detach().clone() if i in written and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))


def buffer_writes(node: fx.Node, plans: dict) -> tuple:
    """((operand position, buffer name, whether the operand is the buffer's placeholder itself),
    ...) of the buffers ``node`` writes in place (BatchNorm statistics, counters, caches);
    ``plans``: node name -> its ``program.NodePlan``."""
    out = []
    for i in written_args(node):
        a = node.args[i]
        if not isinstance(a, fx.Node):
            continue
        root, direct = written_root(a)
        p = plans.get(root.name)
        if root.op == "placeholder" and p is not None and p.kind == "buffer" and p.param_name:
            out.append((i, p.param_name, direct))
    return tuple(out)


def written_from_outside(node: fx.Node, inside: set) -> set:
    """Names of the values from outside ``inside`` (node names) that ``node`` writes in place,
    followed back through views inside (what a recompute region reads and writes)."""
    out = set()
    for i in written_args(node):
        v = node.args[i]
        while isinstance(v, fx.Node) and v.name in inside and is_view(v) and isinstance(v.args[0], fx.Node):
            v = v.args[0]
        if isinstance(v, fx.Node) and v.name not in inside:
            out.add(v.name)
    return out


def is_view(node: fx.Node) -> bool:
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not node.args:
        return False
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def written_root(node: fx.Node) -> tuple[fx.Node, bool]:
    """The node whose storage a write to ``node`` lands in (through view ops), and whether
    ``node`` is that node itself."""
    root = node
    while is_view(root) and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    return root, root is node


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def whole_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is all of ``b`` (the same elements in the same memory)."""
    return (same_storage(a, b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def local_of(v) -> torch.Tensor:
    return v._local_tensor if isinstance(v, DTensor) else v


def write_back(buffers: dict, writes, values, where: str) -> None:
    """After an op wrote buffers in place (``writes``: (buffer name, whether the operand is the
    buffer's placeholder itself) per operand in ``values``): a write that did not land in the whole
    buffer (a sharded or moved value) is copied into it, gathered in full (``full_tensor``: a
    collective only then). ``where``: the op, for the error a lost write raises."""
    for (name, direct), v in zip(writes, values):
        if not isinstance(v, torch.Tensor):
            continue
        buf, local = buffers[name], local_of(v)
        if whole_of(local, buf):
            continue
        if not direct:
            if same_storage(local, buf) and (not isinstance(v, DTensor) or all(p.is_replicate() for p in v.placements)):
                continue                       # a view of the full buffer: written through
            raise NotImplementedError(
                f"{where}: writes a view of buffer {name!r} that the plan shards or moves; the write would be "
                "lost. Plan that buffer replicated (or write the whole buffer, not a slice of it)")
        with torch.no_grad():
            buf.copy_(v.full_tensor() if isinstance(v, DTensor) else v)
