"""benchmarks/tp_crossover.py (cost-model predictions only) runs into a tmp dir: both CSVs have
their rows, the PNG is written, some family beats 1-D somewhere, and inside one 8-GPU node 1-D
communicates least (what the formulas give: 2.5d/3d move the weights, which at b=1 outweigh the
activations)."""
import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("tp_crossover", ROOT / "benchmarks" / "tp_crossover.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tp_crossover_main(tmp_path, capsys):
    bench = _load()
    assert bench.main(["--out", str(tmp_path)]) == 0
    with open(tmp_path / "tp_crossover.csv") as f:
        tp = list(csv.DictReader(f))
    with open(tmp_path / "tp_crossover_cp.csv") as f:
        cp = list(csv.DictReader(f))
    assert (tmp_path / "tp_crossover.png").stat().st_size > 10_000
    # 8: 1d, 2.5d 2x2x2, 3d; 64: 1d, 2d, two 2.5d, 3d; 512: 1d, four 2.5d, 3d; 4096: 1d, 2d, five 2.5d, 3d
    assert [sum(1 for r in tp if r["gpus"] == str(n)) for n in (8, 64, 512, 4096)] == [3, 5, 6, 8]
    assert len(cp) == 2 * 2 * 5 and {r["winner"] for r in cp} <= {"ring", "ulysses"}
    eight = [r for r in tp if r["gpus"] == "8"]
    assert min(eight, key=lambda r: float(r["comm_s"]))["mode"] == "1d"
    hits = bench.crossovers([{**r, "gpus": int(r["gpus"]), "comm_s": float(r["comm_s"])} for r in tp])
    assert any(hits.values()), hits
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "crossover" in out
