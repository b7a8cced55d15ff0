"""Plan files: a plan whose fields disagree, or that is malformed, is a one-line ValueError that
names the field, at load time (so `inspect`, `run` and `autoparallelize` all refuse it)."""
import json

import pytest

from autopar.cost import make_cluster
from autopar.plan import Plan
from autopar.placements import Shard, parse_placements
from autopar.solver import plan_model

from solver_helpers import traced


@pytest.fixture(scope="module")
def plan_dict():
    g, _ = traced("gpt-tiny", batch=8)
    p = plan_model(g, make_cluster("a100-80g", 1), global_batch=8, seq_len=None, force="dp=4,tp=2")
    return p.to_dict()


def _load(d, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    return Plan.load(str(f))


def test_round_trip_is_accepted(plan_dict, tmp_path):
    assert _load(plan_dict, tmp_path).to_dict() == plan_dict


@pytest.mark.parametrize("edit,words", [
    # the case: a top-level degree edited beside the mesh it no longer matches
    (lambda d: d.update(tp=3), "mesh axis tp=2 but tp=3"),
    (lambda d: d.update(dp="2"), "dp='2' is not a positive integer"),
    (lambda d: d.update(dp=2.0), "dp=2.0 is not a positive integer"),
    (lambda d: d.update(dp=0), "dp=0 is not a positive integer"),
    (lambda d: d.update(dp=-4, tp=-2), "is not a positive integer"),
    (lambda d: d.update(zero_stage=5), "zero_stage=5"),
    (lambda d: d.update(pp=2), "1 stages listed for pp=2"),
    (lambda d: d.update(micro_batch_size=4), "!= global_batch(8)"),
    (lambda d: d["cluster"].update(nodes=2), "the cluster has 2 x 8 GPUs"),
    (lambda d: d.update(mesh_shape=[8, 1]), "mesh axis dp=8 but dp=4"),
    (lambda d: d.pop("dp"), "lacks the fields ['dp']"),
    (lambda d: d["cluster"].update(extra=1), "malformed"),
    (lambda d: d["strategies"].append(dict(d["strategies"][0])), "strategies repeat the nodes"),
    (lambda d: d["strategies"][0].update(output="S(0)RR"), "more placements than the 2 mesh axes"),
    (lambda d: d["strategies"][0].update(output="S(abc)"), "not a placement"),
    (lambda d: d["strategies"][0].update(output="S(0"), "without ')'"),
    (lambda d: d["summary"].update(tensor_parallel=8), "summary disagrees with its fields on tensor_parallel"),
])
def test_disagreeing_or_malformed_fields_are_named(plan_dict, tmp_path, edit, words):
    d = json.loads(json.dumps(plan_dict))
    edit(d)
    with pytest.raises(ValueError) as e:
        _load(d, tmp_path)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", ["[]", "2", "{\"schema_version\": 1}"])
def test_not_a_plan_object(tmp_path, content):
    f = tmp_path / "plan.json"
    f.write_text(content)
    with pytest.raises(ValueError, match="plan"):
        Plan.load(str(f))


def test_binary_file_and_directory(tmp_path):
    f = tmp_path / "plan.bin"
    f.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="not a plan JSON file"):
        Plan.load(str(f))
    with pytest.raises(ValueError, match="is a directory"):
        Plan.load(str(tmp_path))


def test_placements_parse_strictly():
    assert parse_placements("S(0)RP") == (Shard(0), *parse_placements("RP"))
    for bad in ("S(abc)", "S(0", "S(-1)", "X"):
        with pytest.raises(ValueError, match="placement"):
            parse_placements(bad)
