"""Smoke run of benchmarks/pipeline_bubble.py --quick: it plans, runs a pipelined model on 2 CPU
gloo ranks with its timing hooks on torch's pipelining, and prints a table row whose measured /
predicted bubble ratio is a finite positive number. No timing is asserted (shared, noisy CPUs)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SEP = re.compile(r"[│┃|]")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in SEP.split(line)[1:-1]] if line.count("│") + line.count("┃") else \
        [c.strip() for c in SEP.split(line)]


def test_pipeline_bubble_quick():
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_bubble.py"), "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(_cells(l) for l in lines if "meas/pred" in l and "schedule" in l)
    rows = [_cells(l) for l in lines if SEP.search(l) and "meas/pred" not in l]
    rows = [r for r in rows if len(r) == len(header) and r[0] == "1f1b"]
    assert len(rows) == 1, proc.stdout
    row = dict(zip(header, rows[0]))
    assert (row["pp"], row["vpp"], row["m"]) == ("2", "1", "2"), row
    assert float(row["pred"]) == pytest.approx(0.5)               # (p - 1) / m
    assert float(row["torch order"]) == pytest.approx(0.5, abs=1e-3)   # torch's 1F1B order, uniform times
    ratio = float(row["meas/pred"])
    assert math.isfinite(ratio) and ratio > 0, row
    assert all(math.isfinite(float(x)) for x in row["idle/compute per rank"].split()), row
