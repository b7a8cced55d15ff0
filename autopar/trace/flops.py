"""Forward FLOPs and bytes moved of one FX node, from the fake tensors in ``node.meta["val"]``.

FLOPs (multiply and add counted separately, as Megatron and ``torch.utils.flop_counter`` do):

- contractions: ``2 * numel(out) * K`` with K the contracted size --
  ``linear`` (K = in.shape[-1], bias adds not counted), ``mm``/``addmm``/``bmm``/``baddbmm``/
  ``matmul``; convolution: K = ``prod(weight.shape[1:])`` (Cin/groups * kernel);
  transposed convolution: ``2 * numel(in) * prod(weight.shape[1:])``.
- ``scaled_dot_product_attention`` (all variants): ``2*B*H*Tq*Tk*D + 2*B*H*Tq*Tk*Dv`` (QK^T and PV),
  i.e. 4BHT^2D. Causal masking is NOT halved -- the Megatron convention (its 4Bs^2h attention term
  is the full square); softmax is not counted.
- ``embedding`` and other gathers/scatters (``index``, ``gather``, ...): 0.
- views (see ``VIEW_OPS``), ``getitem``, placeholders, output, ops without a tensor output: 0.
- every other op (elementwise, norms, softmax, reductions, losses, copies): one FLOP per element of
  the largest tensor it reads or writes -- a small term next to the contractions, kept so that a
  roofline sees them as memory-bound rather than free.

Bytes moved (roofline numerator): bytes of every tensor argument read + bytes of every output
written. 0 for views, ``getitem``, ``split``/``chunk``/``unbind`` (they alias their input),
``reshape``/``flatten``/``contiguous`` of an already contiguous input, and ``to``/``type_as``
that does not change the dtype or device. ``embedding`` reads only the gathered rows:
``2 * bytes(out) + bytes(indices)``.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from autopar.ir import DTYPE_BYTES

# Ops whose output aliases the input (no data movement, no FLOPs).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "transpose", "t", "permute", "expand", "expand_as",
    "split", "split_with_sizes", "chunk", "tensor_split", "unbind", "slice", "select", "squeeze",
    "unsqueeze", "alias", "detach", "as_strided", "view_as", "narrow", "movedim", "swapaxes",
    "swapdims", "diagonal", "unfold", "lift_fresh", "numpy_T", "mT", "mH", "adjoint",
    "view_as_real", "view_as_complex", "real", "imag", "_assert_tensor_metadata",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
})
# Views when the input is contiguous, copies otherwise.
RESHAPE_OPS = frozenset({"reshape", "contiguous", "flatten", "unflatten", "reshape_as"})
# Casts that are no-ops when dtype/device are unchanged.
CAST_OPS = frozenset({"to", "_to_copy", "type_as", "type"})
GATHER_OPS = frozenset({"embedding", "index", "index_select", "gather", "take", "scatter",
                        "scatter_add", "index_put", "index_add", "masked_select"})
MATMUL_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "addbmm",
                        "einsum", "dot", "mv", "addmv", "vdot", "inner", "outer", "tensordot"})
CONV_OPS = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d"})
CONV_T_OPS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
SDPA_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_flash_attention_for_cpu"})


def op_name(node: fx.Node) -> str:
    """Base name of the op: "linear" for aten.linear.default, "getitem" for operator.getitem."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    packet = getattr(t, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(t, "__name__", str(t))


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _val(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_val(x) for x in a)
    return a


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * DTYPE_BYTES.get(str(t.dtype).removeprefix("torch."), t.element_size())


def _contraction_flops(name: str, args: list[Any], outs: list[torch.Tensor]) -> int:
    if not outs:
        return 0
    out = outs[0]
    if name == "linear":
        return 2 * out.numel() * args[0].shape[-1]
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        return 2 * out.numel() * args[1].shape[-1]
    if name in ("mm", "bmm", "matmul", "dot", "vdot", "mv", "inner"):
        return 2 * out.numel() * args[0].shape[-1]
    if name == "outer":
        return out.numel()
    # einsum / tensordot: count with torch's own flop counter on the fake tensors.
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        getattr(torch, name)(*args)
    return int(counter.get_total_flops())


def _sdpa_flops(args: list[Any]) -> int:
    q, k, v = args[0], args[1], args[2]
    *batch, tq, d = q.shape
    tk, dv = k.shape[-2], v.shape[-1]
    bh = math.prod(batch)
    return 2 * bh * tq * tk * d + 2 * bh * tq * tk * dv


def node_cost(node: fx.Node) -> tuple[int, int]:
    """(forward FLOPs, bytes moved) of one call_function node (0, 0 for anything else)."""
    if node.op != "call_function":
        return 0, 0
    name = op_name(node)
    outs = _tensors(node.meta.get("val"))
    if name == "getitem" or name in VIEW_OPS or not outs:
        return 0, 0
    args = [_val(a) for a in node.args]
    ins = _tensors(args) + _tensors([_val(v) for v in node.kwargs.values()])
    if name in RESHAPE_OPS and ins and ins[0].is_contiguous():
        return 0, 0
    if (name in CAST_OPS and ins and ins[0].dtype == outs[0].dtype
            and ins[0].device == outs[0].device):
        return 0, 0
    read = sum(_nbytes(t) for t in ins)
    written = sum(_nbytes(t) for t in outs)
    if name == "embedding":
        return 0, 2 * written + _nbytes(ins[1])
    if name in GATHER_OPS:
        return 0, read + written
    if name in SDPA_OPS:
        return _sdpa_flops(args), read + written
    if name in MATMUL_OPS:
        return _contraction_flops(name, args, outs), read + written
    if name in CONV_OPS:
        return 2 * outs[0].numel() * math.prod(args[1].shape[1:]), read + written
    if name in CONV_T_OPS:
        return 2 * args[0].numel() * math.prod(args[1].shape[1:]), read + written
    return max(t.numel() for t in ins + outs), read + written
