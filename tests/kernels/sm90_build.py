"""Build every kernel for Hopper (sm_90a) without a GPU and report registers and spills.

The interpreter runs kernels as NumPy and accepts code the GPU compiler rejects; this script
runs Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through the ptxas that ships
in the triton wheel) for the configurations the launchers pick for the benchmark shapes, so a
kernel that would not compile on the H200 fails here. It must run with TRITON_INTERPRET unset
(tests/kernels/test_kernel_sm90_build.py starts it in a subprocess):

    env -u TRITON_INTERPRET python tests/kernels/sm90_build.py        # table on stdout
Exit status 1 if any build fails. Register and spill counts are ptxas's, for this Triton version
(the GPU machine runs Triton 3.6; counts there can differ).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_build.py: unset TRITON_INTERPRET (the interpreter replaces the compiler)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import (activations, attention, cross_entropy, norms, optimizers,  # noqa: E402
                     rope, softmax)

TARGET = GPUTarget("cuda", 90, 32)
BF, F32, I64 = "*bf16", "*fp32", "*i64"


def _builds():
    """(label, jit kernel, pointer/float arg types, constexprs, num_warps, num_stages); every
    argument not named in the types is an i32 scalar."""
    ln = {**dict.fromkeys("XRWBYH", BF), "MEAN": F32, "RSTD": F32, "eps": "fp32"}
    ln_b = {**dict.fromkeys(["DY", "X", "W", "DH", "DX"], BF), "MEAN": F32, "RSTD": F32,
            "DW_PART": F32, "DB_PART": F32}
    n = 8192
    out = []
    for rms in (False, True):
        out.append((f"norm fwd N={n} rms={rms} +residual", norms._norm_fwd_kernel, ln,
                    dict(IS_RMS=rms, HAS_RESIDUAL=True, HAS_BIAS=not rms, BLOCK_N=n),
                    norms._row_warps(n), 3))
        out.append((f"norm bwd N={n} rms={rms} +dh", norms._norm_bwd_kernel, ln_b,
                    dict(IS_RMS=rms, HAS_DH=True, HAS_BIAS=not rms, BLOCK_N=n,
                         PREFETCH=norms.bwd_prefetch(rms, True)),
                    norms._row_warps(n, per_thread=16), 3))
        out.append((f"norm bwd N={n} rms={rms}", norms._norm_bwd_kernel, ln_b,
                    dict(IS_RMS=rms, HAS_DH=False, HAS_BIAS=not rms, BLOCK_N=n,
                         PREFETCH=norms.bwd_prefetch(rms, False)),
                    norms._row_warps(n, per_thread=16), 3))
    for n_cols in (8192, 100_000):
        blk, single = softmax._config(n_cols, None)
        out.append((f"softmax fwd N={n_cols}", softmax._softmax_fwd_kernel, dict(X=BF, Y=BF),
                    dict(BLOCK_N=blk, SINGLE=single), norms._row_warps(blk), 3))
        out.append((f"softmax bwd N={n_cols}", softmax._softmax_bwd_kernel,
                    dict(Y=BF, DY=BF, DX=BF), dict(BLOCK_N=blk, SINGLE=single),
                    norms._row_warps(blk), 3))
    ce_block, _, ce_warps = cross_entropy._chunking(128256, cross_entropy.BLOCK_V)
    out.append(("cross_entropy fwd partial", cross_entropy._ce_partial_kernel,
                dict(LOGITS=BF, PART_M=F32, PART_D=F32), dict(BLOCK_V=ce_block), ce_warps, 3))
    out.append(("cross_entropy fwd combine", cross_entropy._ce_combine_kernel,
                dict(LOGITS=BF, TARGET=I64, PART_M=F32, PART_D=F32, LOSS=F32, LSE=F32),
                dict(BLOCK_R=cross_entropy.COMBINE_ROWS, BLOCK_C=8), 4, 3))
    out.append(("cross_entropy bwd", cross_entropy._ce_bwd_kernel,
                dict(LOGITS=BF, TARGET=I64, LSE=F32, SCALE=F32, DLOGITS=BF),
                dict(BLOCK_V=ce_block), ce_warps, 3))
    bm, bn = activations._gelu_blocks(28672)
    for tanh in (False, True):
        out.append((f"bias_gelu fwd tanh={tanh}", activations._bias_gelu_fwd_kernel,
                    dict(X=BF, B=BF, Y=BF),
                    dict(HAS_BIAS=True, APPROX_TANH=tanh, BLOCK_M=bm, BLOCK_N=bn), 8, 3))
        out.append((f"bias_gelu bwd tanh={tanh}", activations._bias_gelu_bwd_kernel,
                    dict(X=BF, B=BF, DY=BF, DX=BF, DB_PART=F32),
                    dict(HAS_BIAS=True, APPROX_TANH=tanh, BLOCK_M=bm, BLOCK_N=bn), 8, 3))
    out.append(("swiglu fwd", activations._swiglu_fwd_kernel, dict(A=BF, B=BF, Y=BF),
                dict(BLOCK=activations.FLAT_BLOCK), 8, 3))
    out.append(("swiglu bwd", activations._swiglu_bwd_kernel,
                dict(A=BF, B=BF, DY=BF, DA=BF, DB=BF), dict(BLOCK=activations.FLAT_BLOCK), 8, 3))
    for bwd in (False, True):
        out.append((f"rope backward={bwd}", rope._rope_kernel, dict(X=BF, COS=BF, SIN=BF, Y=BF),
                    dict(BACKWARD=bwd, BLOCK_R=rope.ROWS_PER_PROGRAM, BLOCK_H=64), 4, 3))
    for d in (64, 128):
        b = attention.default_blocks(d)
        for causal in (True, False):
            tag = f"D={d} causal={causal}"
            out.append((f"attention fwd {tag}", attention._attn_fwd_kernel,
                        dict(Q=BF, K=BF, V=BF, O=BF, LSE=F32, qk_scale="fp32"),
                        dict(CAUSAL=causal, HEAD_D=d, BLOCK_M=b.fwd_m, BLOCK_N=b.fwd_n,
                             UPCAST=False), b.fwd_warps, b.num_stages))
            out.append((f"attention dk/dv {tag}", attention._attn_bwd_dkdv_kernel,
                        dict(Q=BF, K=BF, V=BF, DO=BF, DK=BF, DV=BF, LSE=F32, DELTA=F32,
                             sm_scale="fp32", qk_scale="fp32"),
                        dict(CAUSAL=causal, HEAD_D=d, BLOCK_N=b.bwd_kv_n, BLOCK_M=b.bwd_kv_m,
                             UPCAST=False), b.bwd_kv_warps, b.num_stages))
            out.append((f"attention dq {tag}", attention._attn_bwd_dq_kernel,
                        dict(Q=BF, K=BF, V=BF, DO=BF, DQ=BF, LSE=F32, DELTA=F32,
                             sm_scale="fp32", qk_scale="fp32"),
                        dict(CAUSAL=causal, HEAD_D=d, BLOCK_M=b.bwd_q_m, BLOCK_N=b.bwd_q_n,
                             UPCAST=False), b.bwd_q_warps, b.num_stages))
    out.append(("attention fwd fp32 D=64 (ieee dot)", attention._attn_fwd_kernel,
                dict(Q=F32, K=F32, V=F32, O=F32, LSE=F32, qk_scale="fp32"),
                dict(CAUSAL=True, HEAD_D=64, BLOCK_M=64, BLOCK_N=32, UPCAST=False), 4, 2))
    out.append(("attention bwd preprocess", attention._bwd_preprocess_kernel,
                dict(O=BF, DO=BF, DLSE=F32, DELTA=F32),
                dict(HAS_DLSE=True, HEAD_D=128, BLOCK_M=32), 4, 3))
    scalars = ["decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size",
               "bc2_sqrt", "beta1", "weight_decay", "inv_bc1", "inv_bc2", "lr"]
    flt = dict.fromkeys(scalars, "fp32")
    out.append(("adamw", optimizers._adamw_kernel, {**dict.fromkeys("PGMV", F32), **flt},
                dict(BLOCK=optimizers.ADAMW_BLOCK), 4, 3))
    out.append(("lamb moments", optimizers._lamb_moments_kernel,
                {**dict.fromkeys("PGMV", F32), "CHUNK_START": I64, "CHUNK_END": I64, "PART": F32,
                 **flt}, dict(BLOCK=optimizers.LAMB_BLOCK), 8, 3))
    out.append(("lamb apply", optimizers._lamb_apply_kernel,
                {**dict.fromkeys("PMV", F32), "RATIO": F32, "CHUNK_TENSOR": I64,
                 "CHUNK_START": I64, "CHUNK_END": I64, **flt},
                dict(BLOCK=optimizers.LAMB_BLOCK), 8, 3))
    return out


def _ptxas() -> Path:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newest PTX
        if (bin_dir / name).exists():
            return bin_dir / name
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def build(label, fn, types, consts, num_warps, num_stages, ptxas: Path) -> dict:
    sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=TARGET,
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        rep = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return dict(label=label, warps=num_warps, regs=int(regs.group(1)) if regs else None,
                spill_bytes=int(spill.group(1)) if spill else 0,
                smem_bytes=compiled.metadata.shared, wgmma="wgmma" in ptx)


def main() -> int:
    ptxas = _ptxas()
    failures = 0
    print(f"triton {triton.__version__}, target sm_90a, ptxas {ptxas.name}")
    print(f"{'kernel':42s} {'warps':>5s} {'regs':>5s} {'spill B':>8s} {'smem B':>7s} wgmma")
    for label, fn, types, consts, warps, stages in _builds():
        try:
            r = build(label, fn, types, consts, warps, stages, ptxas)
        except Exception as e:  # report every failing kernel, not just the first
            failures += 1
            print(f"{label:42s} BUILD FAILED: {type(e).__name__}: {str(e)[:400]}")
            continue
        print(f"{label:42s} {r['warps']:5d} {r['regs']:5d} {r['spill_bytes']:8d} "
              f"{r['smem_bytes']:7d} {'yes' if r['wgmma'] else ''}", flush=True)
    print(f"{failures} build failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
