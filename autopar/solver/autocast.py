"""The dtypes a 16-bit plan's activations have on autopar's runtime: ``torch.autocast`` over fp32
parameters (``runtime/precision.py``), as its per-op cast policy gives them.

The graph is traced in fp32 at the level autocast intercepts (``linear``, ``layer_norm``,
``scaled_dot_product_attention``, ``cross_entropy_loss``). Per op (torch's
``aten/src/ATen/autocast_mode.cpp``):

- ``LOW``: matmuls, convolutions and attention cast their float inputs to the low dtype and
  return it;
- ``FP32`` (per device): norms, softmax, exp/log/pow/rsqrt, sums and losses on CUDA; losses and a
  few numerically fragile ops on the CPU: they return fp32;
- every other op runs in the dtype of its inputs, fp32 winning a mix (type promotion): the
  residual stream of a transformer stays fp32 (the embedding and the first add are fp32, a
  block's ``x + proj(y)`` adds a bf16 output to it);
- explicit casts (``.to``, ``.float``) keep the dtype the trace gave them.

So activations are neither all 16-bit (what a plan counted before) nor all fp32; a matmul that
reads an fp32 activation saves the low-precision copy autocast made of it, and of its weight; a
loss of 16-bit logits computes on, and saves, an fp32 copy of them (``saved_copy_factor``,
``weight_copies``, ``upcast_inputs``)."""
from __future__ import annotations

from autopar.ir import DTYPE_BYTES
from autopar.solver.rules import base_name
from autopar.solver.saved import saves_output, savers
from autopar.solver.strategies import FLOAT_DTYPES, GraphFacts, ref_index, tensor_nodes

LOW = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "conv1d", "conv2d", "conv3d", "convolution",
    "_convolution", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "einsum", "mv", "addmv", "addr",
    "chain_matmul", "linalg_multi_dot",
})
_LOSSES = frozenset({
    "cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss",
    "poisson_nll_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss",
})
FP32 = {
    "cuda": _LOSSES | frozenset({
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax",
        "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum", "norm",
    }),
    "cpu": _LOSSES | frozenset({"prod", "cdist", "quantile", "nanquantile", "stft", "trace", "polar"}),
}
_CASTS = frozenset({"to", "_to_copy", "type", "float", "double", "half", "bfloat16"})


def _fp32_ops(device: str) -> frozenset:
    return FP32["cpu" if device == "cpu" else "cuda"]


def autocast_dtypes(facts: GraphFacts, low: str, device: str) -> dict[str, tuple[str, ...]]:
    """Per tensor node, the dtype of each output under ``torch.autocast(device, dtype=low)`` of
    the fp32 trace (module docstring). ``device``: "cuda" (any GPU) or "cpu"."""
    fp32_ops = _fp32_ops(device)
    out: dict[str, tuple[str, ...]] = {}
    for n in tensor_nodes(facts.graph):
        traced = tuple(m.dtype for m in n.outputs)
        if n.kind != "op":
            out[n.key] = traced
            continue
        name = base_name(n.target)
        ins = [out[r.key][ref_index(facts, n, r)] for r in facts.inputs[n.key] if r.key in out]
        floats = [d for d in ins if d in FLOAT_DTYPES]
        if name in LOW and floats:
            made = low
        elif name in fp32_ops or name in _CASTS:
            made = None                                     # as traced: fp32 (or the cast's dtype)
        elif name == "type_as" and len(ins) > 1:
            made = ins[1]
        elif name == "getitem" and ins:
            made = ins[0]
        elif floats:
            made = "float32" if "float32" in floats else floats[0]
        else:
            made = None
        out[n.key] = tuple(made if (made is not None and d in FLOAT_DTYPES) else d for d in traced)
    return out


def compute_dtype(target: str, own: str, low: str, device: str) -> str:
    """The dtype an op of ``target`` reads a float input of dtype ``own`` in under autocast."""
    name = base_name(target)
    if name in LOW:
        return low
    if name in _fp32_ops(device):
        return "float32"
    return own


def saved_copy_factor(facts: GraphFacts, dtypes: dict, low: str, device: str, kept: frozenset) -> dict[str, float]:
    """Per kept node, the bytes autograd keeps for its output as a multiple of the output's own,
    where that is not 1: each op that saves it keeps it in the dtype it computes in
    (``compute_dtype``: a matmul the low copy autocast cast it to, a loss an fp32 copy of 16-bit
    logits), one copy per dtype, the output itself where that is its own dtype or the op that
    makes it saves it."""
    out = {}
    for k in kept:
        own = dtypes[k][0]
        if own not in FLOAT_DTYPES:
            continue
        held = {compute_dtype(t, own, low, device) for t in savers(facts, k)}
        if saves_output(facts.nodes[k].target):
            held.add(own)
        f = sum(DTYPE_BYTES[d] for d in held) / DTYPE_BYTES[own]
        if held and f != 1.0:
            out[k] = f
    return out


# inputs a low-precision op reads but its backward does not save: the bias of linear and of the
# convolutions, the added term of addmm and its kin (their gradient is the output's, summed)
_UNSAVED = {"linear": 2, "conv1d": 2, "conv2d": 2, "conv3d": 2, "convolution": 2, "_convolution": 2, "conv_tbc": 2,
            "conv_transpose1d": 2, "conv_transpose2d": 2, "conv_transpose3d": 2, "addmm": 0, "baddbmm": 0,
            "addbmm": 0, "addmv": 0, "addr": 0}


def weight_copies(facts: GraphFacts, dtypes: dict) -> dict[str, tuple[tuple[int, str], ...]]:
    """Per matmul, the (input position, parameter key) of each fp32 parameter it reads first among
    the matmuls that read it and saves for its backward: autocast casts it once per forward and the
    matmul saves that copy, which lives until the backward (a ZeRO-3 gather, not a leaf, is cast and
    saved at each use, the same bytes). A bias is cast too, but not saved (``_UNSAVED``)."""
    seen: set = set()
    out: dict = {}
    for k in facts.part:
        n = facts.nodes[k]
        if base_name(n.target) not in LOW or not facts.needs_grad.get(k, False):
            continue
        unsaved = _UNSAVED.get(base_name(n.target))
        for pos, r in enumerate(facts.inputs[k]):
            p = facts.nodes[r.key]
            if pos != unsaved and p.kind == "param" and r.key not in seen and dtypes[r.key][0] == "float32":
                seen.add(r.key)
                out.setdefault(k, []).append((pos, r.key))
    return {k: tuple(v) for k, v in out.items()}


def upcast_inputs(facts: GraphFacts, dtypes: dict, low: str, device: str) -> dict[str, tuple[int, ...]]:
    """Per op that autocast runs in fp32, the positions of its ``low`` float inputs: it computes
    on an fp32 copy of each (the loss on the logits: twice their 16-bit bytes, and its backward's
    workspace, ``cost.memory.backward_workspace_bytes``, is at that size)."""
    out = {}
    for k in facts.part:
        n = facts.nodes[k]
        if compute_dtype(n.target, low, low, device) != "float32":
            continue
        pos = tuple(i for i, r in enumerate(facts.inputs[k]) if dtypes[r.key][ref_index(facts, n, r)] == low)
        if pos:
            out[k] = pos
    return out
