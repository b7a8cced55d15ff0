"""Shared settings and tolerances for tests/kernels (imported by the test modules).

Tolerances are (atol, rtol) for torch.testing.assert_close, which also fails on NaN, so an output
element a kernel never wrote (the launchers fill outputs with NaN under AUTOPAR_KERNELS_POISON=1)
fails the comparison. References compute in fp32 from the same (possibly bf16) inputs and round
the result to the input dtype, so bf16 tolerances are about two bf16 ulps (2**-8 relative).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# Where the tests run: "cpu" (Triton's interpreter, the default) or "cuda" (AUTOPAR_TEST_DEVICE=cuda;
# tests/conftest.py then makes cuda torch's default device, so tensors built without a device land
# there). Generators do not follow the default device, hence make_generator.
DEVICE = torch.device(os.environ.get("AUTOPAR_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"


def make_generator(seed: int) -> torch.Generator:
    """A seeded generator on the test device (on the CPU: the same stream as torch.Generator())."""
    return torch.Generator(device=DEVICE).manual_seed(seed)

# The interpreter runs each program in Python, so examples are few and shapes small.
KERNEL_SETTINGS = settings(
    max_examples=int(os.environ.get("AUTOPAR_KERNEL_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)

# forward outputs and elementwise gradients
FWD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
# gradients that involve a reduction over rows or a row-wise dot product
BWD_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def assert_close(actual, expected, tol, what=""):
    atol, rtol = tol
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
