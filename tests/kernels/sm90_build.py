"""Build every kernel for Hopper (sm_90a) without a GPU and report registers and spills.

The interpreter runs kernels as NumPy and accepts code the GPU compiler rejects; this script
runs Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through the ptxas that ships
in the triton wheel) for the configurations the launchers use at the benchmark shapes (every
config of an autotuned kernel's list, labelled "#index" plus its tuned parameters), so a kernel
that would not compile on the H200 fails here, and a config that spills shows it. It must run
with TRITON_INTERPRET unset (tests/kernels/test_kernel_sm90_build.py starts it in a subprocess):

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
WIDTH = 66  # of the label column


def _every_config(label, tuned, types, consts):
    """One build per config of a Tuned list, labelled with its index and tuned parameters."""
    return [(" ".join([f"{label} #{i}", *(f"{k}={v}" for k, v in c.kwargs.items())]), tuned.kernel,
             types, {**consts, **c.kwargs}, c.num_warps, c.num_stages)
            for i, c in enumerate(tuned.configs)]


def _builds():
    """(label, jit kernel, pointer/float arg types, constexprs, num_warps, num_stages); every
    argument not named in the types is an i32 scalar. Tuned kernels: every config of their lists
    at the benchmark shapes (norms N=8192, softmax 8192 and 100000, cross-entropy V=128256,
    bias_gelu and swiglu 8192x28672 bf16, rope (4, 32, 4096, 128) bf16, the optimizers over flat
    fp32 buffers; none of these depends on the size but through the constexprs given here)."""
    ln = {**dict.fromkeys("XRWBYH", BF), "MEAN": F32, "RSTD": F32, "eps": "fp32"}
    ln_b = {**dict.fromkeys(["DY", "X", "W", "DH", "DX"], BF), "MEAN": F32, "RSTD": F32,
            "DW_PART": F32, "DB_PART": F32}
    n = 8192
    out = []
    for rms in (False, True):
        for res in (False, True):
            out += _every_config(f"norm fwd N={n} rms={rms}{' +residual' if res else ''}",
                                 norms.fwd_tuned(n), ln,
                                 dict(IS_RMS=rms, HAS_RESIDUAL=res, HAS_BIAS=not rms, BLOCK_N=n))
        for dh in (False, True):
            out += _every_config(f"norm bwd N={n} rms={rms}{' +dh' if dh else ''}",
                                 norms.bwd_tuned(n, rms), ln_b,
                                 dict(IS_RMS=rms, HAS_DH=dh, HAS_BIAS=not rms, BLOCK_N=n))
    for n_cols in (8192, 100_000):
        blk, single = softmax._config(n_cols, None)
        consts = dict(BLOCK_N=blk, SINGLE=single)
        out += _every_config(f"softmax fwd N={n_cols}", softmax.row_tuned(
            softmax._softmax_fwd_kernel, blk, ("N",)), dict(X=BF, Y=BF), consts)
        out += _every_config(f"softmax bwd N={n_cols}", softmax.row_tuned(
            softmax._softmax_bwd_kernel, blk, ("N",)), dict(Y=BF, DY=BF, DX=BF), consts)
    partial, combine, ce_bwd = cross_entropy._tuned(cross_entropy.BLOCK_V)
    out += _every_config("cross_entropy fwd partial", partial,
                         dict(LOGITS=BF, PART_M=F32, PART_D=F32), {})
    for n_chunks in (8, 32):  # V=128256 in slices of 16384 and of 4096
        out += _every_config(f"cross_entropy combine chunks={n_chunks}", combine,
                             dict(LOGITS=BF, TARGET=I64, PART_M=F32, PART_D=F32, LOSS=F32, LSE=F32),
                             dict(BLOCK_C=n_chunks))
    out += _every_config("cross_entropy bwd", ce_bwd,
                         dict(LOGITS=BF, TARGET=I64, LSE=F32, SCALE=F32, DLOGITS=BF), {})
    bn = activations._gelu_tile(28672)[1]
    gelu_fwd, gelu_bwd = activations._gelu_tuned(bn)
    for tanh in (False, True):
        consts = dict(HAS_BIAS=True, APPROX_TANH=tanh, BLOCK_N=bn)
        out += _every_config(f"bias_gelu fwd N=28672 tanh={tanh}", gelu_fwd,
                             dict(X=BF, B=BF, Y=BF), consts)
        out += _every_config(f"bias_gelu bwd N=28672 tanh={tanh}", gelu_bwd,
                             dict(X=BF, B=BF, DY=BF, DX=BF, DB_PART=F32), consts)
    out += _every_config("swiglu fwd", activations._SWIGLU_FWD, dict(A=BF, B=BF, Y=BF), {})
    out += _every_config("swiglu bwd", activations._SWIGLU_BWD,
                         dict(A=BF, B=BF, DY=BF, DA=BF, DB=BF), {})
    for bwd in (False, True):
        out += _every_config(f"rope D=128 backward={bwd}", rope._TUNED,
                             dict(X=BF, COS=BF, SIN=BF, Y=BF), dict(BACKWARD=bwd, BLOCK_H=64))
    out += _attention_builds()
    out.append(("attention bwd preprocess", attention._bwd_preprocess_kernel,
                dict(O=BF, DO=BF, DLSE=F32, DELTA=F32),
                dict(HAS_DLSE=True, HEAD_D=128, BLOCK_M=32), 4, 3))
    scalars = ["decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size",
               "bc2_sqrt", "beta1", "weight_decay", "inv_bc1", "inv_bc2", "lr"]
    flt = dict.fromkeys(scalars, "fp32")
    out += _every_config("adamw", optimizers._ADAMW, {**dict.fromkeys("PGMV", F32), **flt}, {})
    chunks = dict(CHUNK_START=I64, CHUNK_END=I64)
    lamb = dict(BLOCK=optimizers.LAMB_BLOCK)
    out += _every_config("lamb moments", optimizers._LAMB_MOMENTS,
                         {**dict.fromkeys("PGMV", F32), **chunks, "PART": F32, **flt}, lamb)
    out += _every_config("lamb apply", optimizers._LAMB_APPLY,
                         {**dict.fromkeys("PMV", F32), "RATIO": F32, "CHUNK_TENSOR": I64, **chunks,
                          **flt}, lamb)
    return out


def _attention_builds():
    """Every config of the attention lists (kernels/attention.py), causal and not, labelled like
    _every_config plus the stages: forward and dQ at D=64 and D=128, each dK/dV list at the head
    dim it serves; plus the fp32 forward (ieee products, no tensor cores), which runs its list's
    first config (fp32 is not autotuned). All of these take host-built TMA descriptors (the
    default, AUTOPAR_ATTENTION_DESC=host); the rows labelled "dev-desc" build the kernels' other
    path (AUTOPAR_ATTENTION_DESC=device: plain pointers, descriptors made in the kernel, whose
    global scratch Triton allocates per launch) for each bf16 list's first config, causal and
    not, at D=64 and D=128 (no stages in their labels, to fit the column: #0's, as above)."""
    rows = dict(desc_q="BLOCK_M", desc_do="BLOCK_M", desc_k="BLOCK_N", desc_v="BLOCK_N")

    def types(c, d, dt, device_desc=False):  # host descriptor types carry the config's TMA box
        descs = {a: f"*{dt}" if device_desc else f"tensordesc<{dt}[1,{c.kwargs[r]},{d}]>"
                 for a, r in rows.items()}
        return {**descs, **dict.fromkeys(["O", "DK", "DV", "DQ"], f"*{dt}"), "LSE": F32,
                "DELTA": F32, "qk_scale": "fp32", "sm_scale": "fp32"}

    both = (True, False)
    lists = [("fwd", d, attention._attn_fwd_kernel, attention.FWD_CONFIGS, "bf16", both)
             for d in (64, 128)]
    lists += [("dk/dv", d, attention._attn_bwd_dkdv_kernel, c, "bf16", both)
              for d, c in attention.DKDV_CONFIGS.items()]
    lists += [("dq", d, attention._attn_bwd_dq_kernel, attention.DQ_CONFIGS, "bf16", both)
              for d in (64, 128)]
    lists.append(("fwd fp32", 64, attention._attn_fwd_kernel, attention.FWD_CONFIGS[:1], "fp32",
                  (True,)))
    lists = [(*entry, False) for entry in lists]
    for d in (64, 128):  # the device-descriptor path: first configs
        lists += [("fwd dev-desc", d, attention._attn_fwd_kernel, attention.FWD_CONFIGS[:1],
                   "bf16", both, True),
                  ("dk/dv dev-desc", d, attention._attn_bwd_dkdv_kernel,
                   attention.DKDV_CONFIGS[64 if d <= 64 else 128][:1], "bf16", both, True),
                  ("dq dev-desc", d, attention._attn_bwd_dq_kernel, attention.DQ_CONFIGS[:1],
                   "bf16", both, True)]
    out = []
    for name, d, fn, configs, dt, causals, device_desc in lists:
        for causal in causals:
            for i, c in enumerate(configs):
                label = " ".join([f"attention {name} D={d}{' causal' if causal else ''} #{i}",
                                  *(f"{k}={v}" for k, v in c.kwargs.items()),
                                  *([] if device_desc else [f"stages={c.num_stages}"])])
                out.append((label, fn, types(c, d, dt, device_desc),
                            dict(CAUSAL=causal, HEAD_D=d, UPCAST=False, DEVICE_DESC=device_desc,
                                 **c.kwargs),
                            c.num_warps, c.num_stages))
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
    print(f"{'kernel':{WIDTH}s} {'warps':>5s} {'regs':>5s} {'spill B':>8s} {'smem B':>7s} wgmma")
    for label, fn, types, consts, warps, stages in _builds():
        try:
            r = build(label, fn, types, consts, warps, stages, ptxas)
        except Exception as e:  # report every failing kernel, not just the first
            failures += 1
            print(f"{label:{WIDTH}s} BUILD FAILED: {type(e).__name__}: {str(e)[:400]}")
            continue
        print(f"{label:{WIDTH}s} {r['warps']:5d} {r['regs']:5d} {r['spill_bytes']:8d} "
              f"{r['smem_bytes']:7d} {'yes' if r['wgmma'] else ''}", flush=True)
    print(f"{failures} build failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
