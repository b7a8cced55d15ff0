"""Measure the empirical efficiency factors of autopar's cost model on one CUDA GPU.

    python benchmarks/calibrate.py --out autopar/cost/calibration.json   # on a GPU, < 2 minutes

Measures, each fail-soft (an error is printed and recorded; the old value is kept):
1. HBM bandwidth: device-to-device copy of a 4 GiB bf16 tensor, bytes counted read + write.
   memory_efficiency = copy B/s / datasheet HBM B/s.
2. bf16 GEMMs at transformer-training shapes: tokens M in {4096, 8192}, hidden h in
   {2048, 4096, 8192, 12288}, weight (N, K=h) with N in {h, 3h/t, 4h/t : t in 1, 2, 8}; forward
   Y = X W^T (M,K)x(K,N), backward dX = dY W (M,N)x(N,K) and dW = dY^T X (N,M)x(M,K), each
   2*M*N*K FLOPs. matmul_efficiency = total FLOPs / total time / peak (the FLOP-weighted harmonic
   mean: the one constant that makes the summed roofline prediction equal the summed measured
   time); the FLOP-weighted arithmetic mean of per-shape efficiencies is printed and recorded too.
3. F.scaled_dot_product_attention, causal, bf16, B=1, T=4096 (tokens 4096), D=128, H in
   {16, 32, 64}: forward and forward+backward. FLOPs counted FULL (not halved for causal), as
   autopar/trace does: forward 4*B*H*T*T*D, backward 2.5x forward. attention_efficiency =
   3.5 * fwd FLOPs / (fwd+bwd time) / peak (training time is what the planner predicts);
   forward-only efficiency and the measured bwd/fwd time ratio are recorded.
4. Memory-bound ops: c = a + b (3 tensors of 1 GiB) and layer_norm over h=4096 (read + write).

The measuring functions are shared with ``autopar calibrate`` (``autopar/calibrate_bench.py``).

Writes the calibration JSON (same format as autopar/cost/calibration.json: the input file with
this GPU family's entry replaced) to --out, and prints a table. Timing: CUDA events around a
batch of repetitions after warm-up. Peaks are the datasheet figures from autopar.cost.hardware
(gpu_specs.csv), e.g. 989.4e12 bf16 dense for H100/H200.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autopar.calibrate_bench import (SDPA_TRAIN_FACTOR, copy_Bps, family_of, gemm_shapes,  # noqa: E402
                                     gpu_name_for, sdpa_fwd_flops, summarize_gemms, time_gemm, time_per_call,
                                     time_sdpa)
from autopar.cost.hardware import DEFAULT_CALIBRATION_PATH, get_gpu  # noqa: E402

BUDGET_S = 100.0  # stop starting new GEMM shapes after this much wall time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where to write the calibration JSON")
    ap.add_argument("--base", default=str(DEFAULT_CALIBRATION_PATH),
                    help="calibration JSON to start from (other families are copied unchanged)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, allowed on CPU: checks the script only, NOT a calibration")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    smoke = args.smoke
    if not torch.cuda.is_available() and not smoke:
        print("calibrate.py needs a CUDA GPU (torch.cuda.is_available() is False). Run it on the GPU "
              "you want to calibrate, e.g. through the device tool; --smoke checks the script on CPU.",
              file=sys.stderr)
        return 2
    if smoke and Path(args.out).resolve() == DEFAULT_CALIBRATION_PATH.resolve():
        print("--smoke results are not a calibration; write them somewhere else than "
              f"{DEFAULT_CALIBRATION_PATH}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        device_name, total_bytes = props.name, props.total_memory
        try:
            fam = family_of(device_name)
        except ValueError as e:
            print(f"calibrate.py: {e}", file=sys.stderr)
            return 2
    else:
        device_name, total_bytes, fam = "cpu (smoke)", 0, "h200"
    spec = get_gpu(gpu_name_for(fam, total_bytes), calibration=args.base)
    peak = spec.peak_flops_for("bfloat16")
    bf16 = torch.bfloat16

    measured: dict[str, Any] = {"device": device_name, "torch": torch.__version__,
                                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                "peak_bf16_flops": peak, "datasheet_hbm_Bps": spec.hbm_Bps, "errors": {}}
    rows: list[tuple[str, str, str]] = []  # (what, value, efficiency)

    def fail(what: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        measured["errors"][what] = msg
        rows.append((what, "FAILED", msg[:60]))
        print(f"[calibrate] {what} failed: {msg}", file=sys.stderr)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # 1. HBM copy -------------------------------------------------------------------------------
    copy_eff = None
    try:
        bps = copy_Bps(2**32 if not smoke else 2**22, bf16, dev)   # 4 GiB of bf16, read + write
        copy_eff = bps / spec.hbm_Bps
        measured["copy_Bps"] = bps
        rows.append(("HBM copy 4 GiB (r+w)", f"{bps / 1e9:8.0f} GB/s", f"{copy_eff:.3f}"))
    except Exception as e:  # fail-soft: recorded in the JSON and printed
        fail("hbm_copy", e)

    # 2. GEMMs -----------------------------------------------------------------------------------
    try:
        timed, skipped = [], 0
        for shape in gemm_shapes((4096, 8192) if not smoke else (64,),
                                 (2048, 4096, 8192, 12288) if not smoke else (64, 128)):
            if time.perf_counter() - start > BUDGET_S:
                skipped += 1
                continue
            timed.append((shape, time_gemm(shape, bf16, dev)))
        g = summarize_gemms(timed)
        mm_eff = g.rate / peak
        measured["gemm"] = {
            "efficiency_flop_weighted_harmonic": mm_eff,
            "efficiency_flop_weighted_mean": g.mean_rate / peak,
            "per_pass_efficiency": {k: v / peak for k, v in g.per_pass},
            "per_hidden_efficiency": {str(k): v / peak for k, v in g.per_hidden},
            "worst": {"efficiency": g.worst[0] / peak, "shape": g.worst[1]},
            "shapes_skipped_for_time": skipped,
        }
        rows.append(("GEMM bf16 (all shapes)", f"{g.rate / 1e12:8.1f} TF/s", f"{mm_eff:.3f}"))
        rows.append(("  FLOP-weighted mean eff", "", f"{g.mean_rate / peak:.3f}"))
        for k, v in g.per_pass:
            rows.append((f"  {k}", f"{v / 1e12:8.1f} TF/s", f"{v / peak:.3f}"))
        for k, v in g.per_hidden:
            rows.append((f"  h={k}", f"{v / 1e12:8.1f} TF/s", f"{v / peak:.3f}"))
        rows.append((f"  worst: {g.worst[1]}", "", f"{g.worst[0] / peak:.3f}"))
    except Exception as e:  # fail-soft
        mm_eff = None
        fail("gemm", e)

    # 3. SDPA ------------------------------------------------------------------------------------
    attn_eff = noncausal_eff = None
    try:
        T, D = (4096, 128) if not smoke else (128, 32)
        fwd_f = fb_f = fwd_t = fb_t = 0.0
        per_heads = {}
        for H in ((16, 32, 64) if not smoke else (2,)):
            flops = sdpa_fwd_flops(1, H, T, D)  # FULL count (not halved for causal)
            tf, tb = time_sdpa(1, H, T, D, bf16, dev, causal=True)
            fwd_f += flops; fwd_t += tf; fb_f += SDPA_TRAIN_FACTOR * flops; fb_t += tb
            per_heads[str(H)] = {"fwd_s": tf, "fwdbwd_s": tb, "fwd_eff": flops / tf / peak,
                                 "fwdbwd_eff": SDPA_TRAIN_FACTOR * flops / tb / peak, "bwd_over_fwd": (tb - tf) / tf}
        attn_eff = fb_f / fb_t / peak
        # non-causal fwd+bwd at H=32: attention_noncausal_efficiency (BERT, ViT attention)
        H = 32 if not smoke else 2
        t_nc = time_sdpa(1, H, T, D, bf16, dev, causal=False, forward=False)[1]
        noncausal_eff = SDPA_TRAIN_FACTOR * sdpa_fwd_flops(1, H, T, D) / t_nc / peak
        measured["sdpa"] = {"noncausal_fwdbwd_efficiency_H32": noncausal_eff,"B": 1, "T": T, "D": D, "causal": True, "flop_convention": "FULL 4*B*H*T*T*D fwd",
                            "fwd_efficiency": fwd_f / fwd_t / peak, "fwdbwd_efficiency": attn_eff,
                            "bwd_over_fwd_time": (fb_t - fwd_t) / fwd_t, "per_heads": per_heads}
        rows.append(("SDPA causal fwd", f"{fwd_f / fwd_t / 1e12:8.1f} TF/s", f"{fwd_f / fwd_t / peak:.3f}"))
        rows.append(("SDPA causal fwd+bwd", f"{fb_f / fb_t / 1e12:8.1f} TF/s", f"{attn_eff:.3f}"))
        rows.append(("SDPA NON-causal fwd+bwd H=32", f"{noncausal_eff * peak / 1e12:8.1f} TF/s", f"{noncausal_eff:.3f}"))
        rows.append(("  bwd/fwd time ratio", f"{(fb_t - fwd_t) / fwd_t:8.2f}", "(model: 2.5)"))
    except Exception as e:  # fail-soft
        fail("sdpa", e)

    # 4. Memory-bound ops ------------------------------------------------------------------------
    try:
        n = (2**30 if not smoke else 2**20) // 2             # 1 GiB bf16 each
        a = torch.randn(n, dtype=bf16, device=dev); b = torch.randn_like(a); c = torch.empty_like(a)
        t = time_per_call(lambda: torch.add(a, b, out=c), dev)
        add_bps = 3 * a.numel() * 2 / t
        del a, b, c
        hl = 4096
        x = torch.randn(n // hl, hl, dtype=bf16, device=dev)
        wln = torch.ones(hl, dtype=bf16, device=dev); bln = torch.zeros(hl, dtype=bf16, device=dev)
        t = time_per_call(lambda: F.layer_norm(x, (hl,), wln, bln), dev)
        ln_bps = 2 * x.numel() * 2 / t
        del x
        measured["elementwise"] = {"add_Bps": add_bps, "layer_norm_Bps": ln_bps,
                                   "add_efficiency": add_bps / spec.hbm_Bps,
                                   "layer_norm_efficiency": ln_bps / spec.hbm_Bps}
        rows.append(("add 1 GiB (2r+1w)", f"{add_bps / 1e9:8.0f} GB/s", f"{add_bps / spec.hbm_Bps:.3f}"))
        rows.append(("layer_norm h=4096 (r+w)", f"{ln_bps / 1e9:8.0f} GB/s", f"{ln_bps / spec.hbm_Bps:.3f}"))
    except Exception as e:  # fail-soft
        fail("elementwise", e)

    measured["wall_s"] = time.perf_counter() - start

    # Write -------------------------------------------------------------------------------------
    cal = json.loads(Path(args.base).read_text())
    old = dict(cal["families"].get(fam, {}))
    entry: dict[str, Any] = {}
    got = []
    if mm_eff is not None:
        entry["matmul_efficiency"] = round(mm_eff, 4); got.append("matmul")
    if attn_eff is not None:
        entry["attention_efficiency"] = round(attn_eff, 4); got.append("attention")
        if noncausal_eff is not None:
            entry["attention_noncausal_efficiency"] = round(noncausal_eff, 4)
    if "compute_from" in old and (mm_eff is None or attn_eff is None):
        entry["compute_from"] = old["compute_from"]   # keep sharing if compute was not measured
    else:
        for k in ("matmul_efficiency", "attention_efficiency"):
            entry.setdefault(k, old.get(k))
    entry["memory_efficiency"] = round(copy_eff, 4) if copy_eff is not None else old.get("memory_efficiency")
    if copy_eff is not None:
        got.append("memory")
    missing = [k for k in ("matmul", "attention", "memory") if k not in got]
    entry["source"] = (("SMOKE TEST, not a calibration: " if smoke else "")
                       + f"measured by benchmarks/calibrate.py on {device_name}, torch {torch.__version__}, "
                       + measured["date"]
                       + (f"; NOT measured (kept previous: {old.get('source', '')}): {', '.join(missing)}" if missing else ""))
    entry["measured"] = measured
    cal["families"][fam] = entry
    Path(args.out).write_text(json.dumps(cal, indent=2) + "\n")

    w = max(len(r[0]) for r in rows) if rows else 10
    print(f"\n{device_name}  torch {torch.__version__}  peak bf16 {peak / 1e12:.1f} TF/s  "
          f"HBM {spec.hbm_Bps / 1e9:.0f} GB/s  family {fam}")
    print(f"{'measurement':<{w}}  {'value':>14}  efficiency")
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>14}  {r[2]}")
    print(f"\nwrote {args.out}  ({measured['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
