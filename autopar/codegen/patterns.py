"""Multi-node fusion patterns: regions of the exported graph that one registry kernel replaces.

    matches = find_fusions(gm.graph)       # tuple[Match], disjoint, in anchor order

The matcher is structural (targets, argument positions, single users, static shapes from the
nodes' ``meta["val"]``); whether a match may run fused is decided per call by
``fused.FusedKernels.run_match`` from the placements and dtypes the values actually have. Patterns,
as torch.export's training IR writes them (operands of add/mul in either order):

  add_rms_norm   h = add(a, b); RMSNorm(h)         -> (y, h)   RMSNorm either aten.rms_norm or the
  rms_norm       RMSNorm(x), hand-written:                     hand-written chain below
                   mul(mul(x, rsqrt(add(mean.dim(pow(x, 2) | mul(x, x), [-1], True), eps))), w)
                   (the weight mul optional)
  add_layer_norm h = add(a, b); aten.layer_norm(h)  -> (y, h)
  swiglu         mul(silu(a), b)
  bias_gelu      gelu(add(x, bias)), bias 1-D of x's last dim
  gelu           tanh GeLU, hand-written (GPT-2's gelu_new, HF's NewGELUActivation, nanoGPT):
                   mul(mul(x, 0.5), add(tanh(mul(add(x, mul(pow(x, 3), 0.044715)), sqrt(2/pi))), 1))
  rope           add(mul(x, cos), mul(cat([neg(x2), x1], -1), sin)), x1, x2 the halves of x's
                 last dim by chunk(x, 2, -1) or by two slices (LLaMA's and HF's rotate_half)

A match's nodes other than the anchor (the last one) have no users outside the match, except
the residual ``h`` of add+norm, whose outside users must come after the anchor in graph order:
the executor defers the members and runs the whole region at the anchor.

``Operand(member, index)`` is where a kernel input enters the region: the ``index``-th FX-node
argument of ``member`` in ``fx.node.map_arg`` order, which is also the index of the member's
``NodePlan.inputs`` (so the executor can apply that input's planned edge). ``internal`` lists the
region's own edges (producer, consumer, index), whose planned placements must not move data for
the fused call to be exact.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import fx

ADD, MUL = "aten.add.Tensor", "aten.mul.Tensor"


@dataclass(frozen=True)
class Operand:
    member: str     # FX name of the member node that reads the value
    index: int      # position among that member's FX-node arguments (map_arg order)


@dataclass(frozen=True)
class Match:
    kernel: str                                   # autopar.kernels.registry name
    members: tuple[str, ...]                      # FX names in graph order; the last is the anchor
    operands: tuple[tuple[str, Operand], ...]     # kernel input role -> where it enters
    outputs: tuple[tuple[str, int], ...]          # member -> index of the kernel output it takes
    consts: tuple[tuple[str, Any], ...] = ()      # eps, approximate, ... (from the graph)
    internal: tuple[tuple[str, str, int], ...] = ()   # (producer, consumer, index) inside

    @property
    def anchor(self) -> str:
        return self.members[-1]

    def const(self, name: str, default=None):
        return dict(self.consts).get(name, default)


# ---- graph helpers -------------------------------------------------------------------------------

def _is(n, *targets: str) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and str(n.target) in targets


def node_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's FX-node arguments in ``map_arg`` order, repeats included (``NodePlan.inputs``)."""
    flat: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), flat.append)
    return flat


def _index(consumer: fx.Node, producer: fx.Node) -> int:
    return node_inputs(consumer).index(producer)


def _shape(n) -> Optional[tuple[int, ...]]:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    shape = getattr(val, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def _single_user(n: fx.Node, user: fx.Node) -> bool:
    return set(n.users) == {user}


def _binary(n: fx.Node, pred: Callable[[Any], bool]) -> Optional[tuple[fx.Node, Any]]:
    """For a two-operand node: (the operand satisfying ``pred``, the other one), either order."""
    if len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    a, b = n.args
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def _mul_of(n, target: str) -> Optional[tuple[fx.Node, Any]]:
    """``mul(p, other)`` (either order) where p is a ``target`` node used only here: (p, other)."""
    if not _is(n, MUL):
        return None
    return _binary(n, lambda a: _is(a, target) and _single_user(a, n))


def _tensor_add(n) -> Optional[tuple[fx.Node, fx.Node]]:
    """``add(a, b)`` of two same-shape tensors (no alpha, no broadcast): (a, b)."""
    if not _is(n, ADD) or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    a, b = n.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    if _shape(a) is None or _shape(a) != _shape(b):
        return None
    return a, b


# ---- RMSNorm / LayerNorm, optionally after the residual add --------------------------------------

@dataclass(frozen=True)
class _Norm:
    x: fx.Node                       # the normalized input
    members: tuple[fx.Node, ...]     # graph order, anchor last
    operands: tuple[tuple[str, Operand], ...]   # weight / bias
    consts: tuple[tuple[str, Any], ...]
    kernel: str                      # "rms_norm" | "layer_norm"
    x_readers: tuple[fx.Node, ...]   # members that read x


def _mean_last(n, x_ndim: int) -> Optional[fx.Node]:
    """``mean.dim(p, [-1], keepdim=True)`` over the last dim: p."""
    if not _is(n, "aten.mean.dim") or len(n.args) < 2:
        return None
    dims = n.args[1]
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if not keep or n.kwargs.get("dtype") is not None or len(dims) != 1 or dims[0] % x_ndim != x_ndim - 1:
        return None
    return n.args[0]


def _handwritten_rms(anchor: fx.Node) -> Optional[_Norm]:
    """``x * rsqrt(mean(x^2, -1, keepdim) + eps) [* w]`` ending at ``anchor``."""
    weight = None
    scaled = anchor
    if _is(anchor, MUL):                              # the weight mul, if its operand is x * r
        hit = _binary(anchor, lambda a: _is(a, MUL) and _single_user(a, anchor) and _x_times_rstd(a))
        if hit is not None:
            scaled, weight = hit
            if not isinstance(weight, fx.Node):
                return None
    core = _x_times_rstd(scaled)
    if core is None:
        return None
    if weight is None and len(anchor.users) == 1:
        user = next(iter(anchor.users))
        if _is(user, MUL) and _binary(user, lambda a: a is anchor) and user.args[0] is not user.args[1]:
            return None          # the weight mul follows: match there, with the weight
    x, chain = core
    members = chain + [scaled] + ([anchor] if weight is not None else [])
    eps = chain[2].args[1] if chain[2].args[0] is chain[1] else chain[2].args[0]
    operands = (("weight", Operand(anchor.name, _index(anchor, weight))),) if weight is not None else ()
    return _Norm(x, tuple(members), operands, (("eps", float(eps)),), "rms_norm", (chain[0], scaled))


def _x_times_rstd(n) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """``mul(x, rsqrt(add(mean(pow(x, 2)), eps)))``: (x, [pow, mean, add, rsqrt])."""
    hit = _mul_of(n, "aten.rsqrt.default")
    if hit is None:
        return None
    rsqrt, x = hit
    shape = _shape(x)
    if not isinstance(x, fx.Node) or not shape:
        return None
    add = rsqrt.args[0]
    if not (_is(add, ADD) and _single_user(add, rsqrt)):
        return None
    eps_hit = _binary(add, lambda a: _is(a, "aten.mean.dim"))
    if eps_hit is None or not isinstance(eps_hit[1], (int, float)):
        return None
    mean = eps_hit[0]
    if not _single_user(mean, add):
        return None
    sq = _mean_last(mean, len(shape))
    if sq is None or not _single_user(sq, mean):
        return None
    squares_x = ((_is(sq, "aten.pow.Tensor_Scalar") and sq.args[0] is x and sq.args[1] == 2)
                 or (_is(sq, MUL) and sq.args[0] is x and sq.args[1] is x))
    return (x, [sq, mean, add, rsqrt]) if squares_x else None


def _aten_norm(anchor: fx.Node) -> Optional[_Norm]:
    """``aten.layer_norm`` / ``aten.rms_norm`` over the last dim with constant eps."""
    if _is(anchor, "aten.layer_norm.default"):
        kernel, roles, eps_pos, default_eps = "layer_norm", ("weight", "bias"), 4, 1e-5
    elif _is(anchor, "aten.rms_norm.default"):
        kernel, roles, eps_pos, default_eps = "rms_norm", ("weight",), 3, None
    else:
        return None
    x = anchor.args[0]
    shape = _shape(x)
    if not isinstance(x, fx.Node) or not shape or tuple(anchor.args[1]) != (shape[-1],):
        return None
    operands = []
    for pos, role in enumerate(roles, start=2):
        t = anchor.args[pos] if len(anchor.args) > pos else anchor.kwargs.get(role)
        if isinstance(t, fx.Node):
            operands.append((role, Operand(anchor.name, _index(anchor, t))))
    eps = anchor.args[eps_pos] if len(anchor.args) > eps_pos else anchor.kwargs.get("eps", default_eps)
    return _Norm(x, (anchor,), tuple(operands), (("eps", eps),), kernel, (anchor,))


def _norm_match(anchor: fx.Node, order: dict) -> Optional[Match]:
    norm = _aten_norm(anchor) or _handwritten_rms(anchor)
    if norm is None:
        return None
    add = _tensor_add(norm.x)
    if add is not None:                              # fold the residual add in: (y, h)
        outside = [u for u in norm.x.users if u not in norm.x_readers]
        if all(order[u] > order[anchor] for u in outside):
            h = norm.x
            operands = (("x", Operand(h.name, 0)), ("residual", Operand(h.name, 1))) + norm.operands
            members = (h,) + norm.members
            return Match("add_" + norm.kernel, tuple(m.name for m in members), operands,
                         ((anchor.name, 0), (h.name, 1)), norm.consts, _internal(members))
    if norm.kernel != "rms_norm" or len(norm.members) == 1:
        return None                                   # a lone aten norm is fused.ADAPTERS' job
    reader = norm.x_readers[0]
    operands = (("x", Operand(reader.name, _index(reader, norm.x))),) + norm.operands
    return Match("rms_norm", tuple(m.name for m in norm.members), operands, ((anchor.name, 0),),
                 norm.consts, _internal(norm.members))


# ---- SwiGLU, bias + GeLU -------------------------------------------------------------------------

def _swiglu_match(anchor: fx.Node, order: dict) -> Optional[Match]:
    hit = _mul_of(anchor, "aten.silu.default")
    if hit is None:
        return None
    silu, b = hit
    a = silu.args[0]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or _shape(a) is None or _shape(a) != _shape(b):
        return None
    return Match("swiglu", (silu.name, anchor.name),
                 (("a", Operand(silu.name, 0)), ("b", Operand(anchor.name, _index(anchor, b)))),
                 ((anchor.name, 0),), (), _internal((silu, anchor)))


def _bias_gelu_match(anchor: fx.Node, order: dict) -> Optional[Match]:
    if not _is(anchor, "aten.gelu.default"):
        return None
    add = anchor.args[0]
    if not (_is(add, ADD) and _single_user(add, anchor)):
        return None
    if len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
        return None
    shapes = [_shape(a) for a in add.args]
    if None in shapes:
        return None
    for x, bias, xs, bs in ((*add.args, *shapes), (*add.args[::-1], *shapes[::-1])):
        if len(xs) >= 2 and bs == xs[-1:]:
            break
    else:
        return None
    approximate = anchor.args[1] if len(anchor.args) > 1 else anchor.kwargs.get("approximate", "none")
    return Match("bias_gelu", (add.name, anchor.name),
                 (("x", Operand(add.name, _index(add, x))), ("bias", Operand(add.name, _index(add, bias)))),
                 ((anchor.name, 0),), (("approximate", approximate),), _internal((add, anchor)))


def _scalar_of(n, target: str, value: float) -> Optional[fx.Node]:
    """``target(p, value)`` (either order, ``value`` to 1e-6 relative): p, a node."""
    if not _is(n, target):
        return None
    hit = _binary(n, lambda c: isinstance(c, (int, float)) and not isinstance(c, bool)
                  and abs(c - value) <= 1e-6 * abs(value))
    return hit[1] if hit is not None and isinstance(hit[1], fx.Node) else None


def _tanh_gelu_match(anchor: fx.Node, order: dict) -> Optional[Match]:
    """``mul(mul(x, 0.5), add(tanh(mul(add(x, mul(pow(x, 3), 0.044715)), sqrt(2/pi))), 1))``,
    GPT-2's gelu_new as HF (NewGELUActivation) and nanoGPT write it: gelu(x, approximate="tanh")."""
    if not _is(anchor, MUL) or len(anchor.args) != 2:
        return None
    for half, onep in (anchor.args, anchor.args[::-1]):
        x = _scalar_of(half, MUL, 0.5)
        tanh = _scalar_of(onep, ADD, 1.0)
        if x is None or not _is(tanh, "aten.tanh.default") or half is onep:
            continue
        inner = tanh.args[0]
        s = _scalar_of(inner, MUL, math.sqrt(2 / math.pi))
        hit = _binary(s, lambda a: a is x) if _is(s, ADD) else None
        cube = _scalar_of(hit[1], MUL, 0.044715) if hit is not None else None
        if not (_is(cube, "aten.pow.Tensor_Scalar") and cube.args[0] is x and cube.args[1] == 3):
            continue
        chain = [cube, hit[1], s, inner, tanh, onep, anchor]       # each used by the next one only
        if not (all(_single_user(n, user) for n, user in zip(chain, chain[1:]))
                and _single_user(half, anchor)):
            continue
        members = sorted([*chain, half], key=order.__getitem__)
        first = next(m for m in members if x in node_inputs(m))
        return Match("gelu", tuple(m.name for m in members), (("x", Operand(first.name, _index(first, x))),),
                     ((anchor.name, 0),), (("approximate", "tanh"),), _internal(members))
    return None


# ---- RoPE (rotate-half) ----------------------------------------------------------------------------

def _getitem(n, i: int) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem and n.args[1] == i


def _halves(cat: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """``cat([neg(x2), x1], -1)`` with x1, x2 the halves of x's last dim: (x, [nodes])."""
    if not _is(cat, "aten.cat.default") or len(cat.args[0]) != 2:
        return None
    neg, x1 = cat.args[0]
    if not (_is(neg, "aten.neg.default") and _single_user(neg, cat)):
        return None
    x2 = neg.args[0]
    shape = _shape(cat)
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not shape or dim % len(shape) != len(shape) - 1 or shape[-1] % 2:
        return None
    half = shape[-1] // 2
    if _getitem(x1, 0) and _getitem(x2, 1) and x1.args[0] is x2.args[0]:
        chunk = x1.args[0]
        cdim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
        if not (_is(chunk, "aten.chunk.default") and chunk.args[1] == 2
                and cdim % len(shape) == len(shape) - 1 and set(chunk.users) == {x1, x2}):
            return None
        return chunk.args[0], [chunk, x1, x2, neg]
    if _is(x1, "aten.slice.Tensor") and _is(x2, "aten.slice.Tensor") and x1.args[0] is x2.args[0]:
        def span(s):
            d, start, end = (list(s.args[1:4]) + [0, None, None])[:3]
            return d % len(shape), start, end
        d1, s1, e1 = span(x1)
        d2, s2, e2 = span(x2)
        if d1 == d2 == len(shape) - 1 and s1 in (0, None) and e1 == half and s2 == half and (
                e2 is None or e2 >= shape[-1]) and _single_user(x1, cat) and _single_user(x2, neg):
            return x1.args[0], [x1, x2, neg]
    return None


def _rope_match(anchor: fx.Node, order: dict) -> Optional[Match]:
    if not _is(anchor, ADD) or len(anchor.args) != 2:
        return None
    m1, m2 = anchor.args
    for cos_mul, sin_mul in ((m1, m2), (m2, m1)):
        if not (_is(cos_mul, MUL) and _single_user(cos_mul, anchor) and _single_user(sin_mul, anchor)):
            continue
        rot = _mul_of(sin_mul, "aten.cat.default")
        if rot is None:
            continue
        cat, sin = rot
        halves = _halves(cat)
        if halves is None:
            continue
        x, parts = halves
        hit = _binary(cos_mul, lambda a: a is x)
        if hit is None or not isinstance(hit[1], fx.Node) or not isinstance(sin, fx.Node):
            continue
        cos = hit[1]
        members = sorted([cos_mul, *parts, cat, sin_mul, anchor], key=order.__getitem__)
        operands = (("x", Operand(cos_mul.name, _index(cos_mul, x))),
                    ("cos", Operand(cos_mul.name, _index(cos_mul, cos))),
                    ("sin", Operand(sin_mul.name, _index(sin_mul, sin))))
        return Match("rope", tuple(m.name for m in members), operands, ((anchor.name, 0),), (),
                     _internal(members))
    return None


# ---- the pass -----------------------------------------------------------------------------------

def _internal(members) -> tuple[tuple[str, str, int], ...]:
    inside = {m.name for m in members}
    return tuple((a.name, m.name, i) for m in members for i, a in enumerate(node_inputs(m))
                 if a.name in inside)


MATCHERS = (_norm_match, _rope_match, _swiglu_match, _bias_gelu_match, _tanh_gelu_match)


def find_fusions(graph: fx.Graph) -> tuple[Match, ...]:
    """Every disjoint match of the patterns above, in the order of their anchors."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    claimed: set[str] = set()
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.name in claimed:
            continue
        for matcher in MATCHERS:
            m = matcher(node, order)
            if m is not None and not claimed & set(m.members):
                found.append(m)
                claimed |= set(m.members)
                break
    return tuple(found)
