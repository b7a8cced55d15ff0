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
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return ()
    if t in _RUNNING_STATS:
        pos, flag = _RUNNING_STATS[t]
        return pos if len(node.args) > flag and node.args[flag] is True else ()
    return tuple(i for i, a in enumerate(t._schema.arguments)
                 if i < len(node.args) and a.alias_info is not None and a.alias_info.is_write)


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
