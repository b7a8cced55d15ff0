"""Sharding rules per aten target, on ONE mesh axis: registered functions, a few lines each.

A rule gets the node and the metas of its tensor inputs (``NodeInfo.inputs`` order) and outputs,
and proposes ``Proto``s: the placement of the output and of each tensor input. Rules do not look
at the axis size; ``strategies.py`` drops proposals whose shards do not divide, adds the fully
replicated strategy, and derives gradients and costs. Matmul-like rules come from an einsum
string (``einsum_protos``): for each label L, operands holding L are Shard(their dim of L), the
others Replicate; the output is Shard(its dim of L), or Partial when L is contracted.

Semantics follow ``torch.distributed.tensor``: Shard(d) splits dim d contiguously into equal
pieces; Partial means every rank holds a summand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from autopar.ir import DTYPE_BYTES, NodeInfo, Ref, TensorMeta
from autopar.placements import Partial, Placement, Replicate, Shard

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class Comm:
    """A collective inside an op on the strategy's axis. ``nbytes`` as ``cost.collective_s`` takes it."""
    kind: str        # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all"
    nbytes: float
    phase: str       # "fwd" | "bwd"


@dataclass(frozen=True)
class Proto:
    """A proposed strategy: placements on one axis (output applies to every output of the node)."""
    name: str                          # "colwise", "rowwise", "vocab", "heads", "strided", or "" (auto)
    output: Placement
    inputs: tuple[Placement, ...]
    split: bool = True                 # the op's work is divided over the axis
    comms: tuple[Comm, ...] = ()


RuleFn = Callable[[NodeInfo, Sequence[TensorMeta], Sequence[TensorMeta]], list]
RULES: dict[str, RuleFn] = {}


def rule(*targets: str):
    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            RULES[t] = fn
        return fn
    return deco


def base_name(target: str) -> str:
    """'aten.add.Tensor' -> 'add'; 'getitem' / '<built-in function getitem>' -> 'getitem'."""
    t = str(target)
    if "getitem" in t:
        return "getitem"
    parts = t.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]


def find_rule(target: str) -> Optional[RuleFn]:
    """Exact target first, then the overload-free name ('aten.add.Tensor' -> 'add')."""
    return RULES.get(target) or RULES.get(base_name(target))


# ---- argument helpers ----------------------------------------------------------------------

def arg(node: NodeInfo, i: int, name: str, default=None):
    """Non-tensor argument by position or keyword."""
    if i < len(node.args):
        return node.args[i]
    return dict(node.kwargs).get(name, default)


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# ---- einsum ---------------------------------------------------------------------------------

def einsum_protos(in_labels: Sequence[str], out_labels: str, ins: Sequence[TensorMeta],
                  names: Optional[dict[str, str]] = None, shardable: Optional[str] = None,
                  extra_partial_inputs: Sequence[int] = ()) -> list[Proto]:
    """One proto per label. Operands lacking the label, or broadcasting it (size 1), are R.
    ``extra_partial_inputs``: inputs that must be Partial when the output is Partial (a bias added
    after a contraction: each rank adds 1/t of it, which is a free local op on a replicated bias)."""
    names = names or {}
    sizes: dict[str, int] = {}
    for lab, m in zip(in_labels, ins):
        for c, n in zip(lab, m.shape):
            sizes[c] = max(sizes.get(c, 1), n)
    order = []
    for lab in list(in_labels) + [out_labels]:
        for c in lab:
            if c not in order:
                order.append(c)
    protos = []
    for L in order:
        if shardable is not None and L not in shardable:
            continue
        if sizes.get(L, 1) <= 1:
            continue
        out = Shard(out_labels.index(L)) if L in out_labels else P
        placements: list[Placement] = []
        for i, (lab, m) in enumerate(zip(in_labels, ins)):
            if L in lab and m.shape[lab.index(L)] > 1:
                placements.append(Shard(lab.index(L)))
            elif out == P and i in extra_partial_inputs:
                placements.append(P)
            else:
                placements.append(R)
        protos.append(Proto(names.get(L, ""), out, tuple(placements)))
    return protos


_LETTERS = "abcdefghijlmopqruvwxyz"  # leading (batch-like) labels; k, n, s, t, h... reserved


def _lead(n: int) -> str:
    return _LETTERS[:n]


@rule("aten.linear.default")
def _linear(node, ins, outs):
    x = ins[0]
    lead = _lead(len(x.shape) - 1)
    labels = [lead + "k", "nk"] + (["n"] if len(ins) > 2 else [])
    protos = einsum_protos(labels, lead + "n", ins, names={"n": "colwise", "k": "rowwise"},
                           extra_partial_inputs=(2,))
    # linear in x: a Partial input with a replicated weight gives a Partial output (no bias).
    if len(ins) == 2:
        protos.append(Proto("partial", P, (P, R)))
    return protos


@rule("aten.addmm.default")
def _addmm(node, ins, outs):
    return einsum_protos(["n", "mk", "kn"], "mn", ins, names={"n": "colwise", "k": "rowwise"},
                         extra_partial_inputs=(0,))


@rule("aten.mm.default")
def _mm(node, ins, outs):
    return einsum_protos(["mk", "kn"], "mn", ins)


@rule("aten.bmm.default")
def _bmm(node, ins, outs):
    return einsum_protos(["bmk", "bkn"], "bmn", ins)


@rule("aten.baddbmm.default")
def _baddbmm(node, ins, outs):
    return einsum_protos(["bmn", "bmk", "bkn"], "bmn", ins, extra_partial_inputs=(0,))


@rule("aten.matmul.default")
def _matmul(node, ins, outs):
    a, b = ins[0].shape, ins[1].shape
    if len(a) < 2 or len(b) < 2:
        return []
    nb = max(len(a), len(b)) - 2
    lead = _lead(nb)
    la = lead[nb - (len(a) - 2):] + "mk"
    lb = lead[nb - (len(b) - 2):] + "kn"
    return einsum_protos([la, lb], lead + "mn", ins)


@rule("aten.einsum.default")
def _einsum(node, ins, outs):
    eq = arg(node, 0, "equation")
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        return []
    lhs, out = eq.replace(" ", "").split("->")
    labels = lhs.split(",")
    if len(labels) != len(ins):
        return []
    return einsum_protos(labels, out, ins)


@rule("conv1d", "conv2d", "conv3d", "convolution")
def _conv(node, ins, outs):
    """x (n, c, *spatial), w (o, c/groups, *kernel), bias (o): the batch n and, with groups == 1,
    the output channels o and the contracted input channels c can be sharded; spatial dims cannot
    (halos). With groups > 1 an output-channel shard would need the matching input-channel groups
    (x is not Replicate then), which these per-label protos cannot say: batch only."""
    x, w = ins[0], ins[1]
    general = base_name(node.target) == "convolution"      # (x, w, b, stride, pad, dil, transposed, out_pad, groups)
    if general and arg(node, 6, "transposed", False):
        return []
    groups = arg(node, 8 if general else 6, "groups", 1)
    sp = "".join(chr(ord("p") + i) for i in range(len(x.shape) - 2))
    kn = "".join(chr(ord("u") + i) for i in range(len(w.shape) - 2))
    labels = ["nc" + sp, "oc" + kn] + (["o"] if len(ins) > 2 else [])
    shardable = "n" + ("oc" if groups == 1 else "")
    return einsum_protos(labels, "no" + sp, ins, names={"o": "colwise", "c": "rowwise"}, shardable=shardable,
                         extra_partial_inputs=(2,))


@rule("aten.scaled_dot_product_attention.default")
def _sdpa(node, ins, outs):
    # q (b,h,s,d), k (b,h,t,d), v (b,h,t,e) -> (b,h,s,e); the optional mask broadcasts to (b,h,s,t).
    # Only b, h and the query sequence s can be sharded (softmax over t is not linear). With
    # is_causal or an attn_mask, s cannot: a causal mask is relative to global query positions, so
    # a local query shard is not exact (the runtime would gather; see codegen/fallback.py).
    if len(ins[0].shape) != 4:
        return []
    labels = ["bhsd", "bhtd", "bhte"]
    if len(ins) > 3:
        labels.append("bhst"[4 - len(ins[3].shape):])
    masked = len(ins) > 3 or isinstance(arg(node, 3, "attn_mask"), Ref) or bool(arg(node, 5, "is_causal", False))
    return einsum_protos(labels, "bhse", ins, names={"h": "heads", "s": "seq"},
                         shardable="bh" if masked else "bhs")


# ---- elementwise / broadcasting ---------------------------------------------------------------

def broadcast_protos(ins: Sequence[TensorMeta], out: TensorMeta, skip_dims: Sequence[int] = ()) -> list[Proto]:
    """Output dim d sharded; each input aligned from the right is S(its dim) if it has that dim at
    full size, else R (broadcast: the dim is missing or of size 1). An input whose dim is neither
    gives no proto for d: that happens only in a table of local tensors (``tensor_axes``), where
    an input is the producer's piece on another mesh axis and the op reads it resharded there (a
    data-axis gather into a batch-replicated loss): read as a broadcast, the op's output would be
    split on d from replicated inputs, a split the op does not make."""
    no = len(out.shape)
    protos = []
    for d in range(no):
        if d in skip_dims or out.shape[d] <= 1:
            continue
        placements = []
        for m in ins:
            e = d - (no - len(m.shape))
            size = m.shape[e] if e >= 0 else 1
            if size not in (1, out.shape[d]):
                break
            placements.append(Shard(e) if size == out.shape[d] else R)
        else:
            protos.append(Proto("", Shard(d), tuple(placements)))
    return protos


_ELEMENTWISE = (
    "add", "sub", "mul", "div", "rsub", "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "log", "neg",
    "rsqrt", "sqrt", "pow", "where", "masked_fill", "clone", "contiguous", "_to_copy", "to",
    "type_as", "dropout", "native_dropout", "alias", "detach", "lift_fresh_copy", "erf", "abs",
    "reciprocal", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "eq", "ne", "lt", "le",
    "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_not", "cos", "sin", "square",
    "zeros_like", "ones_like", "full_like", "empty_like", "fill", "leaky_relu", "elu", "hardtanh",
    "gelu_", "silu_", "relu_", "add_", "mul_", "copy", "copy_", "log1p", "expm1", "sign", "floor",
    "ceil", "round", "trunc", "isnan", "logit", "softplus", "mish", "hardswish", "hardsigmoid",
)


def is_elementwise(target: str) -> bool:
    """Whether ``target`` is an elementwise op (its operands broadcast against its output)."""
    return base_name(target) in _ELEMENTWISE


_LINEAR_UNARY = ("clone", "contiguous", "_to_copy", "to", "neg", "alias", "detach", "type_as")


@rule(*_ELEMENTWISE)
def _elementwise(node, ins, outs):
    if not ins or not outs:
        return []
    protos = broadcast_protos(ins, outs[0])
    name = base_name(node.target)
    tensor_operands = len(ins) >= 2 and all(isinstance(a, Ref) for a in node.args[:2])
    if name in ("add", "sub", "add_") and tensor_operands and all(len(m.shape) == len(outs[0].shape) for m in ins):
        protos.append(Proto("partial", P, tuple(P for _ in ins)))        # sum of partials (never + a scalar)
    if name in _LINEAR_UNARY:
        protos.append(Proto("partial", P, (P,) + tuple(R for _ in ins[1:])))
    if name in ("mul", "div") and len(ins) >= 1:
        protos.append(Proto("partial", P, (P,) + tuple(R for _ in ins[1:])))  # linear in the first
    return protos


@rule("tril", "triu")
def _tril(node, ins, outs):
    n = len(outs[0].shape)
    return broadcast_protos(ins, outs[0], skip_dims=(n - 2, n - 1))


@rule("softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(node, ins, outs):
    x = ins[0]
    dim = _norm(arg(node, 1, "dim", -1), len(x.shape))
    protos = broadcast_protos(ins[:1], outs[0], skip_dims=(dim,))
    # softmax over a sharded dim: all-reduce the per-row max and sum-exp (fp32) forward, and the
    # per-row sum(grad * y) backward. Megatron's vocab-parallel cross-entropy does exactly this.
    rows = outs[0].numel // max(1, x.shape[dim])
    protos.append(Proto("vocab", Shard(dim), (Shard(dim),),
                        comms=(Comm("all_reduce", rows * 4 * 2, "fwd"), Comm("all_reduce", rows * 4, "bwd"))))
    return protos


@rule("layer_norm", "native_layer_norm", "rms_norm", "group_norm")
def _layer_norm(node, ins, outs):
    x = ins[0]
    normalized = _dims(arg(node, 1, "normalized_shape", (x.shape[-1],)))
    keep = len(x.shape) - len(normalized)
    protos = []
    for d in range(keep):
        protos.append(Proto("", Shard(d), (Shard(d),) + tuple(R for _ in ins[1:])))
    return protos


@rule("sum", "mean")
def _reduce(node, ins, outs):
    """sum/mean over ``dim`` (all dims when absent); a sharded reduced dim gives a Partial."""
    x = ins[0]
    nd = len(x.shape)
    raw = arg(node, 1, "dim", None)
    dims = _dims(raw) if isinstance(raw, (int, tuple, list)) and not isinstance(raw, bool) else ()
    dims = tuple(_norm(d, nd) for d in dims) or tuple(range(nd))
    keepdim = len(outs[0].shape) == nd
    protos = []
    for d in range(nd):
        if d in dims:
            protos.append(Proto("partial", P, (Shard(d),)))
        else:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            protos.append(Proto("", Shard(od), (Shard(d),)))
    return protos


@rule("amax", "amin", "argmax", "argmin", "max", "min", "var", "std", "var_mean", "norm")
def _reduce_nonlinear(node, ins, outs):
    """Reductions that do not sum: only dims that are kept can be sharded."""
    x = ins[0]
    nd = len(x.shape)
    dims = _dims(arg(node, 1, "dim", None))
    if not dims or not all(isinstance(d, int) for d in dims):
        return []
    dims = tuple(_norm(d, nd) for d in dims)
    keepdim = len(outs[0].shape) == nd
    protos = []
    for d in range(nd):
        if d not in dims:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            protos.append(Proto("", Shard(od), (Shard(d),) + tuple(R for _ in ins[1:])))
    return protos


# ---- views and data movement ----------------------------------------------------------------

def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The dims of ``a`` and of ``b`` a contiguous reshape ``a -> b`` groups together: runs of equal
    product, in order (as far as they match)."""
    groups = []
    i = j = 0
    na, nb = len(a), len(b)
    while i < na and j < nb:
        gi, gj = [i], [j]
        pa, pb = a[i], b[j]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb and i < na:
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < nb:
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                return groups
        groups.append((gi, gj))
    return groups


def view_dim_map(a: Sequence[int], b: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim a Shard moves to under a contiguous reshape ``a -> b``.

    Dims are grouped into runs of equal product; inside a group only the leading non-1 dim can be
    sharded (its shard is a contiguous 1/t of the group's flattened block, the same block the
    leading output dim's shard covers). Divisibility is checked by the caller."""
    out: dict[int, int] = {}
    for gi, gj in view_groups(a, b):
        li = next((d for d in gi if a[d] > 1), None)
        lj = next((d for d in gj if b[d] > 1), None)
        if li is not None and lj is not None:
            out[li] = lj
    return out


def _view_protos(mapping: dict[int, int]) -> list[Proto]:
    protos = [Proto("", Shard(j), (Shard(i),), split=False) for i, j in mapping.items()]
    protos.append(Proto("partial", P, (P,), split=False))
    return protos


@rule("view", "_unsafe_view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
      "_reshape_alias", "view_as")
def _view(node, ins, outs):
    return _view_protos(view_dim_map(ins[0].shape, outs[0].shape))


@rule("expand", "expand_as", "broadcast_to")
def _expand(node, ins, outs):
    protos = broadcast_protos(ins[:1], outs[0])
    return [Proto(p.name, p.output, p.inputs + tuple(R for _ in ins[1:]), split=False) for p in protos]


@rule("transpose", "t", "swapaxes")
def _transpose(node, ins, outs):
    nd = len(ins[0].shape)
    if nd < 2:
        return _view_protos({0: 0} if nd == 1 else {})
    d0 = _norm(arg(node, 1, "dim0", 0), nd) if base_name(node.target) != "t" else 0
    d1 = _norm(arg(node, 2, "dim1", 1), nd) if base_name(node.target) != "t" else 1
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _view_protos({perm[j]: j for j in range(nd)})


@rule("permute")
def _permute(node, ins, outs):
    nd = len(ins[0].shape)
    perm = [_norm(d, nd) for d in arg(node, 1, "dims")]
    return _view_protos({perm[j]: j for j in range(nd)})


@rule("movedim", "moveaxis")
def _movedim(node, ins, outs):
    """A permutation: the source dims land on the destination positions, the others keep their
    order in the positions left (``torch.movedim``)."""
    nd = len(ins[0].shape)
    src, dst = arg(node, 1, "source"), arg(node, 2, "destination")
    src = [_norm(d, nd) for d in ([src] if isinstance(src, int) else src)]
    dst = [_norm(d, nd) for d in ([dst] if isinstance(dst, int) else dst)]
    perm: list = [None] * nd
    for a, b in zip(src, dst):
        perm[b] = a
    rest = iter(d for d in range(nd) if d not in src)
    perm = [next(rest) if p is None else p for p in perm]
    return _view_protos({perm[j]: j for j in range(nd)})


@rule("broadcast_tensors")
def _broadcast_tensors(node, ins, outs):
    """Every output has the broadcast shape: a dim sharded on each output, and on each input that
    has it at full size (``broadcast_protos``)."""
    return broadcast_protos(ins, outs[0]) if outs else []


@rule("getitem")
def _getitem(node, ins, outs):
    nd = len(outs[0].shape) if outs else 0
    return _view_protos({d: d for d in range(nd)})


@rule("split", "split_with_sizes", "chunk", "unbind", "tensor_split")
def _split(node, ins, outs):
    x = ins[0]
    nd = len(x.shape)
    name = base_name(node.target)
    dim = _norm(arg(node, 1 if name == "unbind" else 2, "dim", 0), nd)
    protos = []
    for d in range(nd):
        if d == dim:
            if name != "unbind":
                # Each chunk sharded along the split dim: every rank holds 1/t of every chunk, a
                # strided shard of the input. Valid when the producer's layout is built strided
                # (Megatron interleaves the fused QKV weight rows per rank); codegen must do that.
                protos.append(Proto("strided", Shard(d), (Shard(d),), split=False))
            continue
        od = d - 1 if (name == "unbind" and d > dim) else d
        protos.append(Proto("", Shard(od), (Shard(d),), split=False))
    protos.append(Proto("partial", P, (P,), split=False))
    return protos


@rule("slice", "narrow", "select")
def _slice(node, ins, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = _norm(arg(node, 1, "dim", 0), nd)
    drop = base_name(node.target) == "select"
    protos = []
    for d in range(nd):
        if d == dim:
            if not drop and outs[0].shape[d] == x.shape[d]:       # a full-range slice is a no-op
                protos.append(Proto("", Shard(d), (Shard(d),), split=False))
            continue
        od = d - 1 if (drop and d > dim) else d
        protos.append(Proto("", Shard(od), (Shard(d),), split=False))
    return protos


@rule("cat", "concat", "stack")
def _cat(node, ins, outs):
    nd_out = len(outs[0].shape)
    stack = base_name(node.target) == "stack"
    dim = _norm(arg(node, 1, "dim", 0), nd_out)
    protos = []
    for d in range(nd_out):
        if d == dim:
            continue
        di = d - 1 if (stack and d > dim) else d
        protos.append(Proto("", Shard(d), tuple(Shard(di) for _ in ins), split=False))
    return protos


# ---- embedding and losses --------------------------------------------------------------------

@rule("embedding")
def _embedding(node, ins, outs):
    idx = ins[1]
    no = len(outs[0].shape)
    protos = [Proto("", Shard(d), (R, Shard(d))) for d in range(len(idx.shape))]
    protos.append(Proto("colwise", Shard(no - 1), (Shard(1), R)))
    protos.append(Proto("vocab", P, (Shard(0), R)))        # masked lookup of the local vocab rows
    return protos


def _loss_rows_protos(node, ins, outs, n_extra: int) -> list[Proto]:
    """Rows (batch/sequence) sharded: each rank's loss is a summand (mean: of the local mean / t)."""
    x = ins[0]
    reduce_none = len(outs[0].shape) > 0
    protos = []
    for d in range(len(x.shape)):
        if d == 1 or (len(x.shape) == 1):
            continue
        td = d if d == 0 else d - 1                        # target lacks the class dim 1
        out = Shard(td) if reduce_none else P
        protos.append(Proto("", out, (Shard(d), Shard(td)) + tuple(R for _ in range(n_extra))))
    return protos


@rule("mse_loss", "smooth_l1_loss", "huber_loss")
def _pointwise_loss(node, ins, outs):
    """An elementwise loss of (input, target), reduced or not. Reduced (mean or sum: the output is
    0-d), a split of any dim, alike on both, gives each rank its elements' share: a summand (run
    on each rank's elements, a mean's share scaled: ``codegen/fallback.py``). Not reduced, it is
    elementwise. A regression or denoising loss then runs on each rank's rows, where before it
    had no rule: the data axis gathered the model's output over dp to compute it replicated."""
    if len(ins) < 2 or ins[0].shape != ins[1].shape or not outs:
        return []
    if len(outs[0].shape):                               # reduction="none"
        return broadcast_protos(ins[:2], outs[0])
    return [Proto("", P, (Shard(d), Shard(d))) for d in range(len(ins[0].shape)) if ins[0].shape[d] > 1]


@rule("cross_entropy_loss")
def _cross_entropy(node, ins, outs):
    x = ins[0]
    if len(x.shape) < 2:
        return []
    protos = _loss_rows_protos(node, ins, outs, len(ins) - 2)
    rows = x.numel // x.shape[1]
    # vocab-parallel (Megatron; the runtime uses torch's loss_parallel): logits sharded on the class
    # dim; three forward all-reduces of one value per row: the row max and the row sum-exp (fp32)
    # and the target logit (logits dtype). No comm backward.
    protos.append(Proto("vocab", R, (Shard(1), R) + tuple(R for _ in ins[2:]),
                        comms=(Comm("all_reduce", rows * 4, "fwd"), Comm("all_reduce", rows * 4, "fwd"),
                               Comm("all_reduce", rows * DTYPE_BYTES[x.dtype], "fwd"))))
    return protos


@rule("nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd")
def _nll(node, ins, outs):
    x = ins[0]
    if len(x.shape) < 2:
        return []
    protos = _loss_rows_protos(node, ins, outs, len(ins) - 2)
    # log-probs sharded on the class dim: each rank picks the target entry if it owns it, else 0.
    protos.append(Proto("vocab", P, (Shard(1), R) + tuple(R for _ in ins[2:])))
    return protos


# ---- ops without tensor inputs ----------------------------------------------------------------

@rule("arange", "ones", "zeros", "full", "empty", "rand", "randn", "scalar_tensor", "tensor",
      "new_ones", "new_zeros", "new_full", "new_empty", "_tensor_constant", "randint")
def _creation(node, ins, outs):
    """Any shard is free: each rank creates its slice."""
    if not outs:
        return []
    return [Proto("", Shard(d), tuple(R for _ in ins), split=False) for d in range(len(outs[0].shape))]
