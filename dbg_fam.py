import sys
sys.path.insert(0, "tests/runtime")
from test_memory_measure import measure_families
from autopar.models import build_model
from autopar.plan import Plan
from autopar.runtime.launch import spawn_ranks
from autopar.runtime.memory_measure import compare_ranks
from autopar.trace import trace_model
if __name__ == '__main__':
    fams = dict(a.split("=", 1) for a in sys.argv[1:])
    fams = {k: v.replace(";", ",") for k, v in fams.items()}
    per_rank = spawn_ranks(measure_families, 2, (fams,), timeout_s=120)
    b = build_model("gpt-tiny", device="meta")
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name="gpt-tiny")
    for name in fams:
        plan = Plan.from_json(per_rank[0][name]["plan"])
        row = compare_ranks(plan, graph, [r[name]["memory"] for r in per_rank], "float32", "adamw")[0]
        print("  pred", row.predicted.by_category.as_dict(), "at_peak", row.measured.at_peak.as_dict())
        print(name, plan.summary()["zero_stage"], "peak", row.measured.peak_bytes, row.predicted.peak_bytes, round(row.measured.peak_bytes/row.predicted.peak_bytes-1, 3), "host", row.measured.host_peak_bytes, row.predicted.host_bytes)
