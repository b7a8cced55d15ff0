"""Every kernel builds for Hopper (sm_90a) with its GPU configuration, through Triton's real
compiler and ptxas, on a machine without a GPU (see sm90_build.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("sm90_build.py")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not any((BIN / n).exists() for n in ("ptxas", "ptxas-blackwell")),
                    reason="this triton wheel ships no NVIDIA ptxas")
def test_every_kernel_builds_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 build failure(s)" in proc.stdout
