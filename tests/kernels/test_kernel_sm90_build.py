"""Every kernel builds for Hopper (sm_90a) with its GPU configuration, through Triton's real
compiler and ptxas, on a machine without a GPU, specialized as a launch at the benchmark shapes
is (see sm90_build.py); and no config of a tuned list spills registers there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("sm90_build.py")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ROW = re.compile(r"^(?P<label>\S.*?)\s+(?P<warps>\d+)\s+(?P<regs>\d+)\s+(?P<spill>\d+)\s+"
                 r"(?P<smem>\d+)(?:\s+yes)?\s*$")
# Expected to spill: fp32 attention (full-precision products without tensor cores) runs its
# list's first config untuned, and spills in every config (autopar/kernels/attention.py).
MAY_SPILL = ("attention fwd fp32 ",)


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
    rows = [m for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert len(rows) > 100, proc.stdout[-4000:]  # the table was parsed
    spills = [f"{m['label']}: {m['spill']} B" for m in rows
              if int(m["spill"]) and not m["label"].startswith(MAY_SPILL)]
    assert not spills, "configs that spill registers (drop them from their lists):\n" + "\n".join(
        spills)
