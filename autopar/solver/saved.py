"""Which activations autograd keeps for the backward pass (the activation-memory model).

A tensor is kept when an op that consumes it (directly or through views, which alias) saves that
input for its backward, or when the op that makes it saves its own output:

- saves inputs: matmuls (the activation operand), attention (q, k, v), norms, gelu/silu and other
  activations computed from their input, mul/div/pow, gathers and losses;
- saves its output: softmax / log_softmax, SDPA (output and log-sum-exp), relu, sigmoid, tanh,
  exp, rsqrt, sqrt;
- saves nothing: add/sub, views, copies, casts, reductions that sum, cat/split.
Dropout keeps a 1-byte mask per element.

On a GPT layer this reproduces Korthikanti et al.'s 34 sbh (2022, §4; without the attention score
terms, which fused attention does not materialize): LN inputs 4, QKV input 2, Q/K/V 6, attention
output 2 + projection input 2, MLP 2 + 8 + 8.

When a consumer of ``REGATHERED`` saves an input that reached it through all-gathers only, the
sharded copy is kept and gathered again in backward (Megatron's sequence parallelism; FSDP does the
same for parameters; ``runtime/regather.py``): memory counts the producer's local bytes and
``problem.py`` adds the backward all-gather. Other consumers keep what they save as they got it;
the activation-memory model counts the producer's local bytes for them too (a gathered input of
cross-entropy, ``masked_fill`` or a mul is under-counted: their saved tensor is not the input
itself after DTensor's decompositions, so it cannot be swapped for the shard).
"""
from __future__ import annotations

from typing import Iterator

from autopar.cost.compute import op_kind
from autopar.solver.rules import base_name
from autopar.solver.strategies import GraphFacts

SAVES_INPUT = frozenset({
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm", "gelu", "silu", "mish",
    "softplus", "elu", "leaky_relu", "hardswish", "hardsigmoid", "mul", "div", "pow", "embedding",
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd", "where",
    "masked_fill", "log", "sin", "cos", "erf", "abs", "clamp", "index_select", "gather", "amax",
    "max", "min", "var", "std", "var_mean", "norm", "square", "reciprocal",
})
SAVES_OUTPUT = frozenset({
    "softmax", "_softmax", "log_softmax", "_log_softmax", "relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt",
})
DROPOUT = frozenset({"dropout", "native_dropout"})
DROPOUT_MASK_BYTES_PER_ELEM = 1


def saves_input(target: str) -> bool:
    return op_kind(target) in ("matmul", "attention") or base_name(target) in SAVES_INPUT


def saves_output(target: str) -> bool:
    return op_kind(target) == "attention" or base_name(target) in SAVES_OUTPUT


# operand positions (tensor inputs, in order) a matmul saves: the matrices, not an added bias
_MATMUL_SAVED = {"addmm": (1, 2), "addbmm": (1, 2), "baddbmm": (1, 2), "addmv": (1, 2), "linear": (0, 1),
                 "convolution": (0, 1), "_convolution": (0, 1), "conv1d": (0, 1), "conv2d": (0, 1), "conv3d": (0, 1)}


def saves_operand(target: str, position: int) -> bool:
    """Whether an op of ``target`` keeps its tensor input at ``position`` for backward (all of them
    requiring grad): what ZeRO-3 re-gathers in backward for a parameter operand
    (``runtime/reshard.py``). Matmuls keep the matrices (not an added bias), attention q, k, v,
    layer/RMS norms their weight and bias, batch/group norms their weight (not the bias), an
    embedding its indices (not the table); the rest as ``saves_input``."""
    name = base_name(target)
    kind = op_kind(target)
    if kind == "matmul":
        return position in _MATMUL_SAVED.get(name, (position,))
    if kind == "attention":
        return position < 3
    if name == "embedding":
        return position != 0
    if "batch_norm" in name or "group_norm" in name:
        return position != 2
    return saves_input(target)


# tensor operand positions of ops whose backward keeps one operand only for the other's gradient:
# autograd saves operand i of the pair when the OTHER one requires grad (mm: self for mat2's
# gradient, mat2 for self's); a convolution saves input and weight whenever either does
GRAD_PAIRS = {"linear": (0, 1), "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2),
              "addbmm": (1, 2), "baddbmm": (1, 2), "addmv": (1, 2), "mv": (0, 1), "mul": (0, 1)}

# ops that save a tensor input as the very tensor they got (or a view of it), so that a gathered
# input can be swapped for its shard when saved and gathered again when unpacked: the matrices of
# a matmul, a layer norm's input, weight and bias, gelu/silu's input
REGATHERED = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "linear": (0, 1), "native_layer_norm": (0, 1, 2),
              "layer_norm": (0, 1, 2), "gelu": (0,), "silu": (0,)}
# matmuls that torch.autocast runs in its low dtype: they would save a cast copy of the gathered
# input, so the runtime casts the shard before the gather (``runtime/regather.Regather.cast_for``)
AUTOCAST_LOW = frozenset({"mm", "bmm", "addmm", "linear", "matmul", "baddbmm", "addbmm"})


def saves_operand_given(target: str, position: int, needs_grad) -> bool:
    """Whether an op of ``target`` keeps its tensor input at ``position`` for backward, where
    ``needs_grad(i)`` says whether its tensor input ``i`` needs a gradient (``saves_operand``
    assumes all of them do)."""
    if not saves_operand(target, position):
        return False
    pair = GRAD_PAIRS.get(base_name(target))
    if pair is None or position not in pair:
        return True
    return needs_grad(pair[1 - pair.index(position)])


def regathered_operand(target: str, position: int, needs_grad) -> bool:
    """Whether input ``position`` of an op of ``target``, when it arrives through all-gathers only,
    is kept as the shard and gathered again in backward (``runtime/regather.py``): the op is in
    ``REGATHERED`` and keeps that input (``saves_operand_given``)."""
    if position not in REGATHERED.get(base_name(target), ()):
        return False
    return saves_operand_given(target, position, needs_grad)


def is_dropout(node) -> bool:
    if base_name(node.target) not in DROPOUT:
        return False
    p = node.args[1] if len(node.args) > 1 else dict(node.kwargs).get("p", 0.5)
    return not isinstance(p, (int, float)) or p > 0


def savers(facts: GraphFacts, key: str) -> Iterator[str]:
    """Targets of the ops that save ``key``'s output for backward, directly or through views
    (lazily: ``kept_tensors`` stops at the first)."""
    stack, seen = [key], {key}
    while stack:
        for c, _ in facts.consumers.get(stack.pop(), ()):
            if c in seen or not facts.needs_grad.get(c, False):
                continue
            seen.add(c)
            target = facts.nodes[c].target
            if saves_input(target):
                yield target
            elif c in facts.part and op_kind(target) == "free":
                stack.append(c)


def kept_tensors(facts: GraphFacts) -> frozenset:
    """Keys of op nodes whose output is kept for backward (a view of it counts as it)."""
    return frozenset(k for k in facts.part if op_kind(facts.nodes[k].target) != "free"
                     and facts.needs_grad.get(k, False)
                     and (saves_output(facts.nodes[k].target) or next(savers(facts, k), None) is not None))
