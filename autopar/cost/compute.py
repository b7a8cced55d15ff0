"""Roofline time of one operator on one GPU.

    time = max(flops / (peak_flops(dtype) * efficiency(kind)),  bytes / (hbm_Bps * memory_efficiency))

``kind`` (from ``op_kind``) picks the compute ceiling: "matmul" -> tensor-core peak x
``matmul_efficiency``; "attention" -> tensor-core peak x ``attention_efficiency`` (FULL FLOP
count, 4*B*H*T*T*D forward for causal too, as autopar/trace counts them; a non-causal attention
(BERT, ViT) gets ``attention_noncausal_efficiency``, see ``GPUSpec.attention_eff``); "memory" ->
CUDA-core FP32 rate ("vector" entry of peak_flops), efficiency 1 (elementwise FLOPs almost never
bind), and the bytes at the memory efficiency of the op's class (``memory_class``: "norm",
"activation", "softmax" or "elementwise"; ``GPUSpec.memory_eff_for``: a class measured apart, by
``autopar calibrate`` at transformer activation sizes, or the copy's ``memory_efficiency``);
"free" (views) -> 0. Efficiencies are empirical (calibration.json).

Backward time = ``backward_factor(kind) * forward time``: matmul 2.0 (two GEMMs of the forward's
size: dX and dW); attention 2.5 (FlashAttention-2's backward does 5 GEMMs to the forward's 2 and
runs ~2.5x the forward time; Dao 2023); memory 2.0 (read grad_out + saved input, write grad_in:
roughly twice the forward traffic).
"""
from __future__ import annotations

import functools

from autopar.cost.hardware import GPUSpec

OP_KINDS = ("matmul", "attention", "memory", "free")

_MATMUL = frozenset({
    "linear", "mm", "bmm", "addmm", "matmul", "baddbmm", "addbmm", "einsum", "_scaled_mm",
    "convolution", "conv1d", "conv2d", "conv3d", "_convolution", "addmv", "mv", "dot", "vdot",
})
_ATTENTION = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward", "flex_attention",
})
_FREE = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "transpose", "t", "permute",
    "expand", "expand_as", "unsqueeze", "squeeze", "detach", "alias", "slice", "select", "narrow",
    "split", "split_with_sizes", "chunk", "unbind", "getitem", "as_strided", "flatten", "unflatten",
    "movedim", "lift_fresh", "numpy_t", "mT", "sym_size", "sym_numel", "sym_stride",
    "_assert_tensor_metadata", "_assert_async", "real", "view_as_real", "view_as_complex",
})


# memory-bound ops that run far below the copy bandwidth (CPU: gelu's erf, the norms' and softmax's
# reductions; on the H200 layer_norm reached 0.58 of HBM where a copy reaches 0.88)
_NORM = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                   "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "instance_norm"})
_ACTIVATION = frozenset({"gelu", "silu", "tanh", "sigmoid", "erf", "exp", "log", "elu", "selu", "softplus",
                         "mish", "hardswish"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss",
                      "nll_loss_forward", "nll_loss_nd", "logsumexp"})
MEMORY_CLASSES = ("norm", "activation", "softmax", "elementwise")


def memory_class(target: str) -> str:
    """The class of a memory-bound op whose bandwidth is measured apart (``MEMORY_CLASSES``)."""
    name = _base_name(target)
    if name in _NORM:
        return "norm"
    if name in _ACTIVATION:
        return "activation"
    if name in _SOFTMAX:
        return "softmax"
    return "elementwise"


@functools.lru_cache(maxsize=None)     # a pure function of the target, asked per op per table
def _base_name(target: str) -> str:
    """'aten.linear.default' -> 'linear'; 'torch.ops.aten.mm.out' -> 'mm'; '<built-in function getitem>'
    and 'operator.getitem' -> 'getitem'; 'aten::addmm' -> 'addmm'."""
    t = str(target).strip()
    if t.startswith("<built-in function ") and t.endswith(">"):
        return t[len("<built-in function "):-1]
    t = t.replace("::", ".")
    for prefix in ("torch.ops.", "ops."):
        if t.startswith(prefix):
            t = t[len(prefix):]
    parts = t.split(".")
    if parts[0] in ("aten", "prims", "operator", "_operator", "torch", "F") and len(parts) > 1:
        parts = parts[1:]
    if parts and parts[0] == "nn" and len(parts) > 2 and parts[1] == "functional":
        parts = parts[2:]
    return parts[0]


def op_kind(target: str) -> str:
    """Classify an FX/aten target into "matmul", "attention", "memory" or "free" (views)."""
    name = _base_name(target)
    if name in _MATMUL:
        return "matmul"
    if name in _ATTENTION or "flash" in name or "scaled_dot_product" in name:
        return "attention"
    if name in _FREE:
        return "free"
    return "memory"


def _efficiency(gpu: GPUSpec, kind: str, causal: bool) -> float:
    return gpu.matmul_efficiency if kind == "matmul" else gpu.attention_eff(causal)


def op_time_s(flops: float, bytes_moved: float, dtype: str, gpu: GPUSpec, kind: str, causal: bool = True,
              mclass: str = "elementwise") -> float:
    """Roofline forward time in seconds (module docstring). ``dtype`` is the compute dtype of the op
    (its output's); for "memory"/"free" ops it is not used. ``causal``: for attention, whether the
    kernel is causal (``GPUSpec.attention_eff``; non-causal kernels do all the counted work).
    ``mclass``: a memory op's ``memory_class``."""
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; expected one of {OP_KINDS}")
    if kind == "free":
        return 0.0
    if kind == "memory":
        compute_s = flops / gpu.peak_flops_for("vector") if flops else 0.0
    else:
        compute_s = flops / (gpu.peak_flops_for(dtype) * _efficiency(gpu, kind, causal)) if flops else 0.0
    memory_s = bytes_moved / (gpu.hbm_Bps * (gpu.memory_eff_for(mclass) if kind == "memory" else gpu.memory_efficiency))
    return max(compute_s, memory_s)


def backward_factor(kind: str) -> float:
    """Backward time / forward time: matmul 2.0, attention 2.5, memory 2.0, free 0.0."""
    factors = {"matmul": 2.0, "attention": 2.5, "memory": 2.0, "free": 0.0}
    if kind not in factors:
        raise ValueError(f"unknown op kind {kind!r}; expected one of {OP_KINDS}")
    return factors[kind]
