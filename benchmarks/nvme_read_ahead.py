"""ZeRO-3's parameter rows on NVMe (offload ``nvme_params``): read a group ahead of their gathers
against read on the spot, same ranks, same model, one run.

    python benchmarks/nvme_read_ahead.py                   # 2 CPU ranks (gloo), hidden 256, 8 layers
    python benchmarks/nvme_read_ahead.py --hidden 512 --layers 8 --steps 8 --nvme-dir /mnt/nvme

``runtime/nvme_rows.py`` starts each gather's reads from the masters' files on the store's
threads a group ahead (ZeRO-Infinity's prefetch from NVMe); the planner prices them hidden behind
each pass's compute but for the pass's first group (``cost/offload.py``). This runs one
autoparallelized GPT (``runtime_overhead.BenchGPT``, fp32 AdamW, ``--force dp=N,zero=3,
offload=optimizer+params+nvme+nvme_params``) and times its steps with the read-ahead on and off
(``NvmeRows.ahead_enabled``) in interleaved rounds, the order rotating, so that load from other
processes hits both alike: the median step of the slowest rank, the seconds a rank's thread waited
for reads per step (``NvmeRows.wait_s``), the reads started ahead, and the ratio on / off. The
losses of both modes are the same training (the same rows are read either way).

The files go to ``--nvme-dir`` (default: a temporary directory, usually on a page-cached disk, so
a read there is a memory copy by the store's thread; a real NVMe drive shows the disk's latency).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # ranks import this module as benchmarks.nvme_read_ahead
    sys.path.insert(0, str(ROOT))

MODES = ("ahead", "on_the_spot")


def bench_rank(rank: int, world: int, cfg: dict) -> dict:
    from autopar.api import autoparallelize
    from benchmarks.runtime_overhead import _time_steps, adamw, lm_loss, make_data, make_model

    data = make_data(cfg, cfg["steps"] + cfg["warmup"])
    ex_x, ex_y = data[0]
    pm = autoparallelize(make_model(cfg), (ex_x,), loss_fn=lm_loss, example_target=ex_y, optimizer=adamw,
                         force=f"dp={world},tp=1,pp=1,zero=3,recompute=none,"
                               "offload=optimizer+params+nvme+nvme_params",
                         timeout_s=300, record_collectives=False, nvme_dir=cfg["nvme_dir"])
    rows = pm.store.ctx.nvme_rows
    _time_steps(pm.step, data[:cfg["warmup"]], cfg["warmup"])
    times = {m: [] for m in MODES}
    waits = {m: 0.0 for m in MODES}
    ahead = {m: 0 for m in MODES}
    per_round = max(1, cfg["steps"] // cfg["rounds"])
    for r in range(cfg["rounds"]):
        for mode in MODES[r % 2:] + MODES[:r % 2]:
            rows.ahead_enabled = mode == "ahead"
            w0, a0 = rows.wait_s, rows.read_ahead
            batch = data[cfg["warmup"] + r * per_round: cfg["warmup"] + (r + 1) * per_round]
            times[mode] += _time_steps(pm.step, batch, 0)
            waits[mode] += rows.wait_s - w0
            ahead[mode] += rows.read_ahead - a0
    pm.close()
    return {"times": times, "waits": waits, "ahead": ahead, "reads": rows.reads}


def main(argv=None) -> int:
    from benchmarks.runtime_overhead import add_bench_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--nvme-dir", default=None, help="where the files go (default: a temporary directory)")
    ap.set_defaults(layers=8)
    args = ap.parse_args(argv)
    cfg = dict(vars(args))
    tmp = None
    if cfg["nvme_dir"] is None:
        tmp = tempfile.TemporaryDirectory(prefix="autopar-nvme-bench-")
        cfg["nvme_dir"] = tmp.name

    from autopar.runtime.launch import spawn_ranks
    from benchmarks.runtime_overhead import make_model

    params = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"BenchGPT hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, seq {args.seq}, global batch "
          f"{args.batch}: {params / 1e6:.1f} M params, fp32 AdamW, ZeRO-3 rows on NVMe ({cfg['nvme_dir']}); "
          f"{args.nproc} CPU ranks (gloo); {args.warmup} warm-up + {args.steps} timed steps per mode in "
          f"{args.rounds} interleaved rounds")
    res = spawn_ranks(bench_rank, args.nproc, (cfg,), timeout_s=900, grace_s=120)
    slowest = {m: [max(r["times"][m][i] for r in res) for i in range(len(res[0]["times"][m]))] for m in MODES}
    med = {m: statistics.median(v) for m, v in slowest.items()}
    n = {m: len(slowest[m]) for m in MODES}
    print(f"{'mode':<13}{'median step s':>14}{'min s':>9}{'read wait s/step':>18}{'reads ahead/step':>18}")
    for m in MODES:
        wait = max(r["waits"][m] for r in res) / n[m]
        print(f"{m:<13}{med[m]:>14.4f}{min(slowest[m]):>9.4f}{wait:>18.4f}{res[0]['ahead'][m] / n[m]:>18.1f}")
    print(f"read ahead / on the spot: step {med['ahead'] / med['on_the_spot']:.3f}, time waiting for reads "
          f"{max(r['waits']['ahead'] for r in res) / max(max(r['waits']['on_the_spot'] for r in res), 1e-12):.3f} "
          f"(slowest rank)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
