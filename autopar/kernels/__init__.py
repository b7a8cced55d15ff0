"""Fused Triton kernels for autopar's codegen, each with a plain-PyTorch reference.

One module per kernel family; each reads like a Triton tutorial (docstring with the math and the
memory traffic, the reference, the @triton.jit kernels, the launcher, an autograd.Function):

    norms.py          layer_norm, rms_norm, add_layer_norm, add_rms_norm (fused residual add)
    softmax.py        softmax over rows, online max/sum for rows of any width
    cross_entropy.py  cross_entropy fused with log-softmax, chunked over the vocab, grad in place
    activations.py    bias_gelu (erf / tanh), swiglu
    attention.py      attention (FlashAttention-2 style, returns lse), merge_attention
    attention_configs.py  its autotuned tile lists, fixed tiles for tests, TMA descriptor mode
    rope.py           rope (rotate-half)
    optimizers.py     adamw_step, lamb_step over flat fp32 buffers
    registry.py       name -> KernelEntry(triton, reference, pattern); lookup, for_target, select
    _launch.py        Tuned (config lists autotuned on CUDA), poisoned outputs, device checks
    _agree.py         one tuned config per (kernel, key) for every rank of a distributed run

Tests (CPU, Triton interpreter, about a minute):  pytest tests/kernels
GPU benchmark (H200, < 4 minutes):             python benchmarks/kernel_speed.py --json out.json
The same benchmark on the CPU with tiny shapes:  python benchmarks/kernel_speed.py --dry-run
"""
