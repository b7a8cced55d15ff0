"""Cost-model predictions (nothing measured): tensor-parallel families and context-parallel kinds.

    python benchmarks/tp_crossover.py                              # H100 nodes of 8, into benchmarks/results
    python benchmarks/tp_crossover.py --gpu a100-80g --out /tmp/tp --nic-aggregation

(a) GPT-3 175B layer (h=12288, a=96, s=2048, b=1, fp16): per-GPU communication bytes and time of
each tensor-parallel family shape (``autopar.cost.tensor_parallel.tp_shapes``) at 8, 64, 512 and
4096 GPUs, on ``make_cluster(gpu, nodes=max(1, n/8))`` with the family's mesh innermost (inner
axes fill a node first). Time = the layer's collectives, forward + backward, serial, one
micro-batch (2.5d's depth all-reduce of dW is paid per micro-batch here). The crossover of a
family is the smallest GPU count at which its best shape communicates for less time than 1-D.
Compute per layer (the same for every family: ideal split) is shown for scale.

(b) Ring attention vs Ulysses per attention layer (``autopar.cost.context_parallel.best_cp_kind``)
for LLaMA-3 8B (h=4096, a=32, a_kv=8, d=128) and 70B (h=8192, a=64, a_kv=8), bf16, b=1, causal,
cp = 8 (one node) and 32 (four nodes), sequences 8K..1M: ring = its EXPOSED transfer time,
Ulysses = its all-to-all time.

Writes ``tp_crossover.csv`` (a), ``tp_crossover_cp.csv`` (b) and ``tp_crossover.png`` into --out.
"""
from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
GPT3 = dict(hidden=12288, seq=2048, batch=1, heads=96, bytes_per_elem=2)
TP_GPUS = (8, 64, 512, 4096)
LLAMA3 = {"llama3-8b": dict(heads=32, kv_heads=8, head_dim=128), "llama3-70b": dict(heads=64, kv_heads=8, head_dim=128)}
CP_DEGREES = (8, 32)
SEQS = (8192, 32768, 131072, 524288, 1048576)
TP_COLUMNS = ("gpu", "gpus", "mode", "shape", "fwd_bytes", "bwd_bytes", "total_bytes", "comm_fwd_s", "comm_bwd_s",
              "comm_s", "vs_1d", "compute_s", "param_bytes", "activation_bytes", "gathered_weight_bytes", "notes")
CP_COLUMNS = ("gpu", "model", "cp", "seq", "winner", "ring_exposed_s", "ulysses_s", "ring_comm_s", "ring_bytes",
              "ulysses_bytes", "attention_compute_s", "note")


def _layer_compute_s(gpu, hidden: int, seq: int, batch: int, heads: int, bytes_per_elem: float, tp: int) -> float:
    """Forward + backward of one layer on one of ``tp`` GPUs (ideal split): linears 2 N 12h^2 at the
    matmul efficiency (backward 2x), attention 4 b s^2 h full count at the causal attention one (2.5x)."""
    dtype = "float16" if bytes_per_elem == 2 else "float32"
    peak = gpu.peak_flops_for(dtype)
    linear = 3 * 2 * batch * seq * 12 * hidden**2 / (peak * gpu.matmul_efficiency)
    attention = 3.5 * 4 * batch * seq**2 * hidden / (peak * gpu.attention_eff(True))
    return (linear + attention) / tp


def tp_rows(gpu: str = "h100", gpus: Sequence[int] = TP_GPUS, nic_aggregation: bool = False) -> list[dict]:
    from autopar.cost.hardware import make_cluster
    from autopar.cost.tensor_parallel import layer_comm, layer_comm_time, layer_memory, tp_shapes

    rows = []
    for n in gpus:
        cluster = make_cluster(gpu, nodes=max(1, n // 8))
        base = None
        for fam in tp_shapes(n):
            comm = layer_comm(fam, **GPT3)
            t = layer_comm_time(comm, cluster, nic_aggregation=nic_aggregation)
            mem = layer_memory(fam, **GPT3)
            base = t.total_s if fam.mode == "1d" else base
            rows.append({"gpu": cluster.gpu.name, "gpus": n, "mode": fam.mode, "shape": str(fam),
                         "fwd_bytes": comm.bytes("fwd"), "bwd_bytes": comm.bytes("bwd"), "total_bytes": comm.bytes(),
                         "comm_fwd_s": t.forward_s, "comm_bwd_s": t.backward_s, "comm_s": t.total_s,
                         "vs_1d": t.total_s / base, "compute_s": _layer_compute_s(cluster.gpu, tp=n, **GPT3),
                         "param_bytes": mem.param_bytes, "activation_bytes": mem.activation_bytes,
                         "gathered_weight_bytes": mem.gathered_weight_bytes, "notes": "; ".join(comm.notes)})
    return rows


def crossovers(rows: Sequence[dict]) -> dict[str, Optional[tuple[int, str]]]:
    """Per family mode: (smallest GPU count where its best shape's comm time < 1-D's, that shape)."""
    out: dict[str, Optional[tuple[int, str]]] = {}
    for mode in ("2d", "2.5d", "3d"):
        out[mode] = None
        for n in sorted({r["gpus"] for r in rows}):
            one_d = next(r for r in rows if r["gpus"] == n and r["mode"] == "1d")
            mine = [r for r in rows if r["gpus"] == n and r["mode"] == mode]
            best = min(mine, key=lambda r: r["comm_s"], default=None)
            if best is not None and best["comm_s"] < one_d["comm_s"]:
                out[mode] = (n, best["shape"])
                break
    return out


def cp_rows(gpu: str = "h100", cps: Sequence[int] = CP_DEGREES, seqs: Sequence[int] = SEQS,
            nic_aggregation: bool = False) -> list[dict]:
    from autopar.cost.context_parallel import best_cp_kind, ring_traffic, ulysses_traffic
    from autopar.cost.hardware import make_cluster

    rows = []
    for model, dims in LLAMA3.items():
        for cp in cps:
            cluster = make_cluster(gpu, nodes=max(1, cp // 8))
            dtype = "bfloat16" if "bfloat16" in dict(cluster.gpu.peak_flops) else "float16"
            for s in seqs:
                ch = best_cp_kind(cluster, cp, s, 1, **dims, dtype=dtype, nic_aggregation=nic_aggregation)
                ring_b = ring_traffic(cp, s, 1, dims["kv_heads"], dims["head_dim"]).total_bytes
                uly_b = (ulysses_traffic(cp, s, 1, **dims).total_bytes if ch.ulysses_s is not None else None)
                rows.append({"gpu": cluster.gpu.name, "model": model, "cp": cp, "seq": s, "winner": ch.kind,
                             "ring_exposed_s": ch.ring_s, "ulysses_s": ch.ulysses_s,
                             "ring_comm_s": ch.ring.forward_comm_s + ch.ring.backward_comm_s,
                             "ring_bytes": ring_b, "ulysses_bytes": uly_b, "attention_compute_s": ch.compute_s,
                             "note": ch.note})
    return rows


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else r[k]) for k in columns})


def _print_table(title: str, columns: Sequence[str], cells: Sequence[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print(title)
        print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for r in cells:
            print(" | ".join(x.ljust(w) for x, w in zip(r, widths)))
        return
    t = Table(title=title)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i < 2 else "right")
    for r in cells:
        t.add_row(*r)
    Console(width=200).print(t)


def _flags(row: dict) -> str:
    return ("h" if "heads=" in row["notes"] else "") + ("s" if "sequence" in row["notes"] else "")


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def write_plot(tp: Sequence[dict], cp: Sequence[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2)
    for i, mode in enumerate(("1d", "2d", "2.5d", "3d")):
        pts = []
        for n in sorted({r["gpus"] for r in tp}):
            mine = [r for r in tp if r["gpus"] == n and r["mode"] == mode]
            if mine:
                best = min(mine, key=lambda r: r["comm_s"])
                pts.append((n, best["comm_s"] * 1e3, best["shape"]))
        left.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i}", label=f"{mode} (best shape)")
        for n, ms, shape in pts:
            left.annotate(shape.split(" ")[1], (n, ms), textcoords="offset points", xytext=(0, 6), ha="center",
                          fontsize=7)
    ticks = sorted({r["gpus"] for r in tp})
    left.set(xscale="log", yscale="log", xticks=ticks, xticklabels=[str(n) for n in ticks],
             xlabel="GPUs in the tensor-parallel group",
             ylabel="predicted comm ms per layer (fwd+bwd)",
             title=f"GPT-3 175B layer, b=1 s=2048 fp16, {tp[0]['gpu']} (cost model)")
    left.legend(fontsize=8)
    left.grid(True, alpha=0.3)
    for j, (model, cpd) in enumerate((m, c) for m in LLAMA3 for c in sorted({r["cp"] for r in cp})):
        pts = sorted((r for r in cp if r["model"] == model and r["cp"] == cpd), key=lambda r: r["seq"])
        right.plot([r["seq"] for r in pts], [r["ring_exposed_s"] * 1e3 for r in pts], "-o", color=f"C{j}",
                   label=f"{model} cp={cpd} ring (exposed)")
        right.plot([r["seq"] for r in pts if r["ulysses_s"] is not None],
                   [r["ulysses_s"] * 1e3 for r in pts if r["ulysses_s"] is not None], "--s", color=f"C{j}",
                   label=f"{model} cp={cpd} Ulysses")
    right.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="predicted comm ms per attention layer",
              title="ring vs Ulysses (cost model)")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--gpu", default="h100", choices=("h100", "a100-80g"), help="GPU of the 8-GPU nodes")
    ap.add_argument("--nic-aggregation", action="store_true",
                    help="groups with k members per node use k NICs (collectives.axis_link); default one NIC per GPU")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tp = tp_rows(args.gpu, nic_aggregation=args.nic_aggregation)
    cp = cp_rows(args.gpu, nic_aggregation=args.nic_aggregation)
    _write_csv(args.out / "tp_crossover.csv", TP_COLUMNS, tp)
    _write_csv(args.out / "tp_crossover_cp.csv", CP_COLUMNS, cp)
    write_plot(tp, cp, args.out / "tp_crossover.png")
    _print_table(f"(a) PREDICTED per GPU per GPT-3 175B layer, one micro-batch, {tp[0]['gpu']} nodes of 8"
                 + (", NIC aggregation" if args.nic_aggregation else ""),
                 ("gpus", "shape", "MB fwd+bwd", "comm ms", "vs 1d", "compute ms", "param MB", "act MB", "flags"),
                 [[str(r["gpus"]), r["shape"], f"{r['total_bytes'] / 1e6:.1f}", _ms(r["comm_s"]), f"{r['vs_1d']:.2f}",
                   _ms(r["compute_s"]), f"{r['param_bytes'] / 1e6:.1f}",
                   f"{(r['activation_bytes'] + r['gathered_weight_bytes']) / 1e6:.1f}", _flags(r)] for r in tp])
    print("flags: h = heads (96) not divisible by the head split (no real layout; formula extrapolated); "
          "s = sequence-split attention K|V gather added (b=1 < token split; derived, not in the papers). "
          "act MB includes 3d's saved gathered weights.")
    for mode, hit in crossovers(tp).items():
        print(f"crossover {mode:>4}: " + (f"beats 1d from {hit[0]} GPUs ({hit[1]})" if hit else "never beats 1d here"))
    _print_table(f"(b) PREDICTED ring vs Ulysses per attention layer (b=1, bf16, causal), {cp[0]['gpu']}",
                 ("model", "cp", "seq", "winner", "ring exposed ms", "ulysses ms", "ring comm ms", "attn compute ms"),
                 [[r["model"], str(r["cp"]), str(r["seq"]), r["winner"], _ms(r["ring_exposed_s"]), _ms(r["ulysses_s"]),
                   _ms(r["ring_comm_s"]), _ms(r["attention_compute_s"])] for r in cp])
    print(f"wrote {args.out / 'tp_crossover.csv'}, {args.out / 'tp_crossover_cp.csv'}, {args.out / 'tp_crossover.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
