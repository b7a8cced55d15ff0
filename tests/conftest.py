"""Session-wide test settings.

Kernel tests run on the CPU through Triton's interpreter with NaN-poisoned outputs; both variables
must be set before triton is imported anywhere in the session, hence here at the root. On a GPU
machine, `AUTOPAR_TEST_DEVICE=cuda` runs the kernel tests compiled for the device instead
(benchmarks/gpu_check.sh does this).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))      # one_process.py, also for spawned ranks

if os.environ.get("AUTOPAR_TEST_DEVICE", "cpu") == "cuda":
    import torch

    torch.set_default_device("cuda")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("AUTOPAR_KERNELS_POISON", "1")
