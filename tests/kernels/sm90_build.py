"""Build every kernel for Hopper (sm_90a) without a GPU and report registers and spills.

The interpreter runs kernels as NumPy and accepts code the GPU compiler rejects; this script
runs Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through the ptxas that ships
in the triton wheel) for the configurations the launchers use at the benchmark shapes (every
config of an autotuned kernel's list, labelled "#index" plus its tuned parameters), so a kernel
that would not compile on the H200 fails here, and a config that spills shows it. It must run
with TRITON_INTERPRET unset (tests/kernels/test_kernel_sm90_build.py starts it in a subprocess):

    env -u TRITON_INTERPRET python tests/kernels/sm90_build.py        # table on stdout
    env -u TRITON_INTERPRET python tests/kernels/sm90_build.py --no-attrs   # see below

Each build is specialized as a real launch at the benchmark shapes (benchmarks/kernel_cases.py)
is: every argument gets a stand-in value (pointers: 16-byte aligned mock tensors, as every buffer
the launchers pass is; integers: their values at the benchmark shape; host TMA descriptors: built
as the launcher builds them, boxes sized by the config's pre_hook), and Triton's own launch-time
binder (the one ``JITFunction.run`` uses) turns them into the signature, the constants and the
attributes: ``tt.divisibility = 16`` on every pointer and on every integer divisible by 16, an
integer equal to 1 compiled as a constant. Without these attributes loads compile to scalar
loads and the register counts differ from the GPU's (rope: 80 against 40); ``--no-attrs`` drops
the divisibility attributes to show that build. Exit status 1 if any build fails. Register and
spill counts are ptxas's, for this Triton version (the GPU machine runs Triton 3.6; counts there
can differ).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_build.py: unset TRITON_INTERPRET (the interpreter replaces the compiler)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from autopar.kernels import (activations, attention, cross_entropy, norms, optimizers,  # noqa: E402
                     rope, softmax)

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
BF, F32, I64, FP = "*bf16", "*fp32", "*i64", "fp32"  # pointer and float argument stand-ins
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "i64": torch.int64}
WIDTH = 66  # of the label column

# The benchmark shapes (benchmarks/kernel_cases.py, full size); the integer arguments below are
# what the launchers pass there.
M, N = 16384, 8192  # norms, softmax (softmax also builds rows of 100000)
CE_M, CE_V = 8192, 128256  # cross-entropy logits
FF_M, FF_N = 8192, 28672  # bias_gelu, swiglu
B, H, T, D = 4, 32, 4096, 128  # attention (also at D=64), rope
OPT_N, LAMB_TENSORS = 1 << 28, 32  # optimizers: one flat fp32 buffer, LAMB over equal tensors


def _every_config(label, tuned, args, consts):
    """One build per config of a Tuned list, labelled with its index and tuned parameters."""
    return [(" ".join([f"{label} #{i}", *(f"{k}={v}" for k, v in c.kwargs.items())]), tuned.kernel,
             args, {**consts, **c.kwargs}, c.num_warps, c.num_stages)
            for i, c in enumerate(tuned.configs)]


@functools.cache
def _builds():
    """(label, jit kernel, arguments, constexprs, num_warps, num_stages). ``arguments`` gives
    every non-constexpr argument of the kernel (extra names are ignored): a pointer by its type
    ("*bf16"), a float scalar as "fp32", an integer by its value at the benchmark shape, a host
    TMA descriptor as the object. Tuned kernels: every config of their lists at the benchmark
    shapes (norms 16384x8192, softmax rows of 8192 and 100000, cross-entropy 8192x128256 with
    every chunk count its partial configs give, bias_gelu and swiglu 8192x28672 bf16, rope
    (4, 32, 4096, 128) bf16, the optimizers over 2^28 fp32 (LAMB: 32 equal tensors))."""
    ln = {**dict.fromkeys("XRWBYH", BF), "MEAN": F32, "RSTD": F32, "eps": FP, "N": N,
          **dict.fromkeys(["stride_x", "stride_r", "stride_y", "stride_h"], N)}
    ln_b = {**dict.fromkeys(["DY", "X", "W", "DH", "DX"], BF), "MEAN": F32, "RSTD": F32,
            "DW_PART": F32, "DB_PART": F32, "M": M, "N": N,
            **dict.fromkeys(["stride_dy", "stride_x", "stride_dh", "stride_dx"], N)}
    out = []
    for rms in (False, True):
        for res in (False, True):
            out += _every_config(f"norm fwd N={N} rms={rms}{' +residual' if res else ''}",
                                 norms.fwd_tuned(N), ln,
                                 dict(IS_RMS=rms, HAS_RESIDUAL=res, HAS_BIAS=not rms, BLOCK_N=N))
        for dh in (False, True):
            out += _every_config(f"norm bwd N={N} rms={rms}{' +dh' if dh else ''}",
                                 norms.bwd_tuned(N, rms), ln_b,
                                 dict(IS_RMS=rms, HAS_DH=dh, HAS_BIAS=not rms, BLOCK_N=N))
    for n_cols in (N, 100_000):
        blk, single = softmax._config(n_cols, None)
        consts = dict(BLOCK_N=blk, SINGLE=single)
        strides = dict.fromkeys(["N", "stride_x", "stride_y", "stride_dy", "stride_dx"], n_cols)
        out += _every_config(f"softmax fwd N={n_cols}", softmax.row_tuned(
            softmax._softmax_fwd_kernel, blk, ("N",)), dict(X=BF, Y=BF, **strides), consts)
        out += _every_config(f"softmax bwd N={n_cols}", softmax.row_tuned(
            softmax._softmax_bwd_kernel, blk, ("N",)), dict(Y=BF, DY=BF, DX=BF, **strides), consts)
    partial, combine, ce_bwd = cross_entropy._tuned(cross_entropy.BLOCK_V)
    chunk_counts = sorted({triton.cdiv(CE_V, c.kwargs["BLOCK_V"]) for c in partial.configs})
    stride_p = max(chunk_counts)  # as _lse_and_loss: room for the narrowest slices
    ce = dict(LOGITS=BF, TARGET=I64, PART_M=F32, PART_D=F32, LOSS=F32, LSE=F32, SCALE=F32,
              DLOGITS=BF, M=CE_M, V=CE_V, stride_l=CE_V, stride_d=CE_V, stride_p=stride_p,
              stride_s=0, ignore_index=-100)  # stride_s: reduction="mean" (one scale)
    out += _every_config("cross_entropy fwd partial", partial, ce, {})
    for n_chunks in chunk_counts:  # V=128256 in slices of 16384, 8192 and 4096
        out += _every_config(f"cross_entropy combine chunks={n_chunks}", combine,
                             dict(ce, n_chunks=n_chunks),
                             dict(BLOCK_C=triton.next_power_of_2(n_chunks)))
    out += _every_config("cross_entropy bwd", ce_bwd, ce, {})
    bn = activations._gelu_tile(FF_N)[1]
    gelu_fwd, gelu_bwd = activations._gelu_tuned(bn)
    gelu = dict(X=BF, B=BF, Y=BF, DY=BF, DX=BF, DB_PART=F32, M=FF_M, N=FF_N,
                **dict.fromkeys(["stride_x", "stride_y", "stride_dy", "stride_dx"], FF_N))
    for tanh in (False, True):
        consts = dict(HAS_BIAS=True, APPROX_TANH=tanh, BLOCK_N=bn)
        out += _every_config(f"bias_gelu fwd N={FF_N} tanh={tanh}", gelu_fwd, gelu, consts)
        out += _every_config(f"bias_gelu bwd N={FF_N} tanh={tanh}", gelu_bwd, gelu, consts)
    swiglu = dict(A=BF, B=BF, Y=BF, DY=BF, DA=BF, DB=BF, numel=FF_M * FF_N)
    out += _every_config("swiglu fwd", activations._SWIGLU_FWD, swiglu, {})
    out += _every_config("swiglu bwd", activations._SWIGLU_BWD, swiglu, {})
    for bwd in (False, True):
        out += _every_config(f"rope D={D} backward={bwd}", rope._TUNED,
                             dict(X=BF, COS=BF, SIN=BF, Y=BF, n_lead=B * H, T=T, HALF=D // 2),
                             dict(BACKWARD=bwd, BLOCK_H=triton.next_power_of_2(D // 2)))
    out += _attention_builds()
    out.append(("attention bwd preprocess", attention._bwd_preprocess_kernel,
                dict(O=BF, DO=BF, DLSE=F32, DELTA=F32, n_rows=B * H * T),
                dict(HAS_DLSE=True, HEAD_D=D, BLOCK_M=32), 4, 3))
    scalars = ["decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size",
               "bc2_sqrt", "beta1", "weight_decay", "inv_bc1", "inv_bc2", "lr"]
    opt = {**dict.fromkeys("PGMV", F32), **dict.fromkeys(scalars, FP), "numel": OPT_N,
           "PART": F32, "RATIO": F32, "CHUNK_TENSOR": I64, "CHUNK_START": I64, "CHUNK_END": I64,
           "n_chunks": len(optimizers.lamb_chunks(
               [i * (OPT_N // LAMB_TENSORS) for i in range(LAMB_TENSORS)] + [OPT_N], OPT_N)[0])}
    out += _every_config("adamw", optimizers._ADAMW, opt, {})
    lamb = dict(BLOCK=optimizers.LAMB_BLOCK)
    out += _every_config("lamb moments", optimizers._LAMB_MOMENTS, opt, lamb)
    out += _every_config("lamb apply", optimizers._LAMB_APPLY, opt, lamb)
    return out


def _attention_builds():
    """Every config of the attention lists (autopar/kernels/attention.py), causal and not, labelled like
    _every_config plus the stages: forward and dQ at D=64 and D=128, each dK/dV list at the head
    dim it serves; plus the fp32 forward (ieee products, no tensor cores), which runs its list's
    first config (fp32 is not autotuned). All of these take host-built TMA descriptors (the
    default, AUTOPAR_ATTENTION_DESC=host), made by the launcher's ``_desc`` over (B, H, T, d)
    and sized by the config's pre_hook as a launch does; the rows labelled "dev-desc" build the
    kernels' other path (AUTOPAR_ATTENTION_DESC=device: plain pointers, descriptors made in the
    kernel, whose global scratch Triton allocates per launch) for each bf16 list's first config,
    causal and not, at D=64 and D=128 (no stages in their labels, to fit the column: #0's, as
    above). Sequences of T=4096 queries and keys."""
    def args(c, consts, dt, device_desc):
        tensors = {f"desc_{n}": MockTensor(DTYPES[dt], [B, H, T, consts["HEAD_D"]])
                   for n in ("q", "k", "v", "do")}
        descs = tensors if device_desc else {n: attention._desc(t) for n, t in tensors.items()}
        out = {**descs, **dict.fromkeys(["O", "DK", "DV", "DQ"], f"*{dt}"), "LSE": F32,
               "DELTA": F32, "qk_scale": FP, "sm_scale": FP, "T_Q": T, "T_K": T}
        if c.pre_hook is not None:  # sizes the host descriptors' boxes, as Tuned.run does
            c.pre_hook({**out, **consts})
        return out

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
                consts = dict(CAUSAL=causal, HEAD_D=d, UPCAST=False, DEVICE_DESC=device_desc,
                              **c.kwargs)
                out.append((label, fn, args(c, consts, dt, device_desc), consts, c.num_warps,
                            c.num_stages))
    return out


@functools.cache
def _binder(fn):
    """The function ``JITFunction.run`` binds a launch's arguments with (its specialization)."""
    return create_function_from_signature(fn.signature, fn.params, BACKEND)


def specialize(fn, args, consts, options):
    """(signature, constexprs, attrs) of ``fn`` launched with ``args`` (see _builds) and
    ``consts``, derived as a launch derives them: the stand-in values go through Triton's binder
    and ``JITFunction._pack_args``, so every pointer (16-byte aligned) and every integer divisible
    by 16 gets ``tt.divisibility = 16``, an integer equal to 1 becomes a constant, an integer
    past int32 an i64, as on the GPU."""
    values = {}
    for a in fn.arg_names:
        if a in consts:
            continue
        if a not in args:
            raise KeyError(f"{fn.__name__}: no benchmark value for argument {a!r} (sm90_build)")
        v = args[a]
        if isinstance(v, str):
            if v.startswith("*"):
                v = MockTensor(DTYPES[v[1:]])  # data_ptr() 0: 16-byte aligned
            elif v == FP:
                v = 1.0  # floats are not specialized on their value
            else:
                raise ValueError(f"{fn.__name__}: argument {a!r}: unknown stand-in {v!r}")
        values[a] = v
    kwargs = {**values, **consts, **options}
    bound, specialization, opts = _binder(fn)(**kwargs)
    _, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, opts)
    return signature, constexprs, attrs


def _ptxas() -> Path:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newest PTX
        if (bin_dir / name).exists():
            return bin_dir / name
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def build(label, fn, args, consts, num_warps, num_stages, ptxas: Path, attrs=True) -> dict:
    options = dict(num_warps=num_warps, num_stages=num_stages)
    signature, constexprs, attributes = specialize(fn, args, consts, options)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs=attributes if attrs else None)
    compiled = triton.compile(src, target=TARGET, options=options)
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


def _build_at(index: int, ptxas: Path, attrs: bool) -> tuple:
    """(result dict or None, error text or None) of build ``index`` of ``_builds()`` (a forked
    worker finds the list in the cache it inherited)."""
    label, fn, args, consts, warps, stages = _builds()[index]
    try:
        return build(label, fn, args, consts, warps, stages, ptxas, attrs), None
    except Exception as e:  # report every failing kernel, not just the first
        return None, f"{type(e).__name__}: {str(e)[:400]}"


def main(argv=None) -> int:
    """Build every entry of ``_builds()``, the compiles spread over the machine's cores (forked
    workers: the build list holds kernels and descriptors, which do not pickle), the table printed
    in the list's order."""
    import multiprocessing

    attrs = "--no-attrs" not in (sys.argv[1:] if argv is None else argv)
    ptxas = _ptxas()
    failures, spilled = 0, []
    print(f"triton {triton.__version__}, target sm_90a, ptxas {ptxas.name}, "
          + ("specialized as launches at the benchmark shapes" if attrs
             else "--no-attrs: without tt.divisibility"))
    print(f"{'kernel':{WIDTH}s} {'warps':>5s} {'regs':>5s} {'spill B':>8s} {'smem B':>7s} wgmma")
    builds = _builds()  # before the fork: the workers inherit it
    job = functools.partial(_build_at, ptxas=ptxas, attrs=attrs)
    with multiprocessing.get_context("fork").Pool(max(1, min(os.cpu_count() or 1, len(builds)))) as pool:
        for (label, *_), (r, error) in zip(builds, pool.imap(job, range(len(builds)))):
            if error is not None:
                failures += 1
                print(f"{label:{WIDTH}s} BUILD FAILED: {error}")
                continue
            print(f"{label:{WIDTH}s} {r['warps']:5d} {r['regs']:5d} {r['spill_bytes']:8d} "
                  f"{r['smem_bytes']:7d} {'yes' if r['wgmma'] else ''}", flush=True)
            if r["spill_bytes"]:
                spilled.append(label)
    print(f"{len(spilled)} build(s) spill: {'; '.join(spilled) or 'none'}")
    print(f"{failures} build failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
