"""benchmarks/largest_model.py --quick into a tmp dir: each configuration's largest model trains on
2 CPU gloo ranks with a measured device peak within the budget; autopar's model is larger than
ZeRO-3's, which is larger than DDP's; the CSV has the three rows. No timing is asserted (shared,
noisy CPUs)."""
import csv
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# the ranks import the benchmark by its module name, benchmarks.largest_model (a namespace package
# under the repository root)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def test_largest_model_quick(tmp_path, capsys):
    from benchmarks import largest_model

    # autopar capped at 14 layers (it fits far more: --quick alone says how many; ZeRO-3 fits 11) and
    # 2 plain steps (the second timed) before the measured one, to keep the test short
    assert largest_model.main(["--quick", "--max-layers", "14", "--steps", "2", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "largest_model.csv") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["DDP", "ZeRO-3", "autopar"]
    for r in rows.values():
        assert 0 < float(r["peak_mib"]) <= float(r["budget_mib"]), r
        assert r["layers"] == r["planned_layers"], r       # the planned model itself fit (the plan's peak held)
        assert float(r["step_s"]) > 0 and float(r["loss_last"]) == float(r["loss_last"]), r
    params = {k: int(r["params"]) for k, r in rows.items()}
    assert params["autopar"] > params["ZeRO-3"] > params["DDP"], params
    assert float(rows["autopar"]["params_vs_ddp"]) == pytest.approx(params["autopar"] / params["DDP"])
    out = capsys.readouterr().out
    assert "largest GPT" in out and "only ratios from one run are comparable" in out
