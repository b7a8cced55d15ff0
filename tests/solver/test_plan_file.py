"""Plan files are data: a plan file that is malformed, mistyped or whose fields disagree is a
one-line ValueError that names the field by its JSON path and says what to do, at load time (so
`inspect`, `run` and `autoparallelize` all refuse it); strategies that do not fit the model's graph
(nodes it does not have, nodes without one, Shard dims beyond a tensor's) are refused when the plan
is compiled against the graph. Never a traceback, a raw torch error or a silently accepted file."""
import json

import pytest

from autopar.cli import main
from autopar.codegen.program import compile_program
from autopar.cost import make_cluster
from autopar.plan import Plan
from autopar.placements import Shard, parse_placements
from autopar.solver import plan_model

from solver_helpers import traced

FIX = "autopar plan ... --json FILE"


@pytest.fixture(scope="module")
def plan_dict():
    g, _ = traced("gpt-tiny", batch=8)
    p = plan_model(g, make_cluster("a100-80g", 1), global_batch=8, seq_len=None, force="dp=4,tp=2")
    return p.to_dict()


@pytest.fixture(scope="module")
def graphs():
    """gpt-tiny at batch 8, fully traced (as the runtime compiles it): with the loss, and forward only."""
    from autopar.trace import trace_model

    _, b = traced("gpt-tiny", batch=8)
    full = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       collapse_repeats=False, model_name="gpt-tiny")
    forward = trace_model(b.module, b.example_inputs, collapse_repeats=False, model_name="gpt-tiny")
    return full, forward


def _copy(d):
    return json.loads(json.dumps(d))


def _write(tmp_path, d=None, text=None, data=None):
    f = tmp_path / "plan.json"
    if data is not None:
        f.write_bytes(data)
    else:
        f.write_text(text if text is not None else json.dumps(d))
    return f


def _load(d, tmp_path):
    return Plan.load(str(_write(tmp_path, d)))


def _refused(f, words, capsys):
    """Plan.load and `autopar inspect` both refuse the file ``f`` with one line holding ``words``."""
    with pytest.raises(ValueError) as e:
        Plan.load(str(f))
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert message.startswith(str(f)), message                     # says which file
    assert main(["inspect", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err, err
    return message


def test_round_trip_is_accepted(plan_dict, tmp_path):
    assert _load(plan_dict, tmp_path).to_dict() == plan_dict
    assert Plan.from_dict(Plan.from_dict(plan_dict).to_dict()).to_dict() == plan_dict     # tuples, unserialized
    bom = _write(tmp_path, data=b"\xef\xbb\xbf" + json.dumps(plan_dict).encode())     # saved by a Windows editor
    assert Plan.load(str(bom)).to_dict() == plan_dict


@pytest.mark.parametrize("model,force", [
    ("gpt-tiny", "tp=2,pp=2,dp=2,sp=on,zero=3,recompute=full"),
    ("gpt-tiny", "pp=2,dp=4,zero=1,recompute=selective,schedule=gpipe"),
    ("gpt:hidden=64,layers=4,heads=4,vocab=256,seq=32", "pp=2,dp=4,schedule=interleaved_1f1b,vpp=2"),
    ("gpt:hidden=64,layers=4,heads=4,vocab=256,seq=32", "pp=2,tp=2,dp=2,schedule=zbv"),
    ("mlp", "dp=8"),
])
def test_every_plan_the_solver_writes_loads(tmp_path, capsys, model, force):
    g, _ = traced(model, batch=8)
    plan = plan_model(g, make_cluster("a100-80g", 1), global_batch=8, seq_len=None, force=force)
    f = tmp_path / "plan.json"
    plan.save(str(f))
    assert Plan.load(str(f)) == plan
    assert main(["inspect", str(f)]) == 0, capsys.readouterr().err


def test_inspect_prints_the_plan_strings_as_text(plan_dict, tmp_path, capsys):
    """Names in a plan file are not rich markup: "[/x]" is printed, not a MarkupError traceback."""
    d = _copy(plan_dict)
    d.update(model_name="[/x] [bold]m", notes=["[/y]"])
    d["cluster"]["name"] = "[/c]"
    d["strategies"][0]["name"] = "[/n]"
    d["step_time"]["comm_s"] = {f"[/k]{k}": v for k, v in d["step_time"]["comm_s"].items()}
    assert main(["inspect", str(_write(tmp_path, d))]) == 0
    out = capsys.readouterr().out
    assert all(w in out for w in ("[/x] [bold]m", "[/y]", "[/c]", "[/n]", "[/k]")), out


def test_solver_plans_fit_their_graph(plan_dict, graphs):
    """The graph check accepts what the solver writes: the plan is for the collapsed trace, the
    runtime compiles the full one (layer copies read layer 0's strategy)."""
    full, forward = graphs
    plan = Plan.from_dict(plan_dict)
    assert not compile_program(full, plan).unplanned
    compile_program(forward, plan)
    g, _ = traced("gpt-tiny", batch=8)
    compile_program(full, plan_model(g, make_cluster("a100-80g", 1), global_batch=8, seq_len=None,
                                     force="tp=2,pp=2,dp=2,sp=on,zero=3,recompute=full"))


def _strategy(d, key_part):
    return next(s for s in d["strategies"] if key_part in s["key"])


# (edit of the plan's dict, words the one-line error must hold)
CASES = [
    # missing, unknown and mistyped fields, named by their JSON path
    (lambda d: d.pop("dp"), "invalid plan: it lacks the field dp"),
    (lambda d: d.update(dp="2"), 'dp: "2" is not a whole number'),
    (lambda d: d.update(dp=2.0), "dp: 2.0 is not a whole number"),
    (lambda d: d.update(dp=True), "dp: true is not a whole number"),
    (lambda d: d.update(dp=1e12), "dp: 1000000000000.0 is not a whole number"),
    (lambda d: d.update(dp=10 ** 12), "dp: 1000000000000 is more than 1048576"),
    (lambda d: d.update(extra=1), "it has unknown field extra"),
    (lambda d: d["cluster"].update(extra=1), "cluster has unknown field extra (was it written by another tool?)"),
    (lambda d: d["cluster"].pop("gpu"), "cluster lacks the field gpu"),
    (lambda d: d["cluster"].update(nodes="1"), 'cluster.nodes: "1" is not a whole number'),
    (lambda d: d["cluster"].update(memory_budget_bytes=-1), "cluster.memory_budget_bytes: -1 is not >= 0"),
    (lambda d: d.update(cluster="a100"), 'cluster: "a100" is not an object'),
    (lambda d: d["step_time"].update(compute_s="1.0"), 'step_time.compute_s: "1.0" is not a number'),
    (lambda d: d["step_time"].update(total_s=0), "step_time.total_s: 0 is not > 0"),
    (lambda d: d["step_time"]["comm_s"].update(x="1"), 'step_time.comm_s["x"]: "1" is not a number'),
    (lambda d: d["step_time"].update(comm_s=[1.0]), "step_time.comm_s: [1.0] is not an object"),
    (lambda d: d["memory"].pop("params_bytes"), "memory lacks the field params_bytes"),
    (lambda d: d["memory"].update(params_bytes="x"), 'memory.params_bytes: "x" is not a whole number'),
    (lambda d: d["memory"].update(total_bytes=1.5), "memory.total_bytes: 1.5 is not a whole number"),
    (lambda d: d.update(notes="tuned"), 'notes: "tuned" is not an array'),
    (lambda d: d.update(notes=[1]), "notes[0]: 1 is not a string"),
    (lambda d: d.update(forced=["tp"]), 'forced: ["tp"] is not an object'),
    (lambda d: d.update(seq_len="x"), 'seq_len: "x" is not a whole number or null'),
    (lambda d: d.update(model_fingerprint=None), "model_fingerprint: null is not a non-empty string"),
    (lambda d: d.update(sequence_parallel="no"), 'sequence_parallel: "no" is not true or false'),
    (lambda d: d.update(mesh_axes="dptp"), 'mesh_axes: "dptp" is not an array'),
    (lambda d: d["stages"][0].update(memory_bytes="x"), 'stages[0].memory_bytes: "x" is not a whole number'),
    (lambda d: d["stages"][0].update(extra=1), "stages[0] has unknown field extra"),
    (lambda d: d.update(strategies={}), "strategies: {} is not an array"),
    (lambda d: d.update(strategies=[]), "strategies: [] lists no node"),
    (lambda d: d["strategies"][0].pop("output"), "strategies[0] lacks the field output"),
    (lambda d: d["strategies"][0].update(key=3), "strategies[0].key: 3 is not a non-empty string"),
    (lambda d: d["strategies"][0].update(inputs="RR"), 'strategies[0].inputs: "RR" is not an array'),
    (lambda d: d["summary"].update(extra=1), "summary has unknown field extra"),
    (lambda d: d.update(summary=[]), "summary: [] is not an object"),
    (lambda d: d.update(schema_version="1"), 'plan schema_version "1" is not the supported 1'),
    (lambda d: d.pop("schema_version"), "has no schema_version, so it is not a plan file"),
    # placements that do not parse
    (lambda d: d["strategies"][0].update(output="S(abc)"), 'strategies[0].output: "S(abc)" is not a placement list'),
    (lambda d: d["strategies"][0].update(output="S(0"), 'strategies[0].output: "S(0" is not a placement list'),
    (lambda d: d["strategies"][0].update(output="X"), 'strategies[0].output: "X" is not a placement list'),
    (lambda d: d["strategies"][0].update(output=0), "strategies[0].output: 0 is not a placement string"),
    # well typed, but the fields disagree (plan_problems)
    (lambda d: d.update(tp=3), "mesh axis tp=2 but tp=3"),
    (lambda d: d.update(dp=0), "dp=0 is not a positive integer"),
    # negative degrees whose product is the world: each named
    (lambda d: (d.update(dp=-4, tp=-2, mesh_shape=[-4, -2]), d.pop("summary")), "dp=-4 is not a positive integer"),
    (lambda d: d.update(zero_stage=5), "zero_stage=5"),
    (lambda d: d.update(pp=2), "1 stages listed for pp=2"),
    (lambda d: d.update(micro_batch_size=4), "!= global_batch(8)"),
    (lambda d: d["cluster"].update(nodes=2), "the cluster has 2 x 8 GPUs"),
    (lambda d: d.update(mesh_shape=[8, 1]), "mesh axis dp=8 but dp=4"),
    (lambda d: d.update(mesh_axes=["dp", "x"]), "name axes other than dp and tp"),
    (lambda d: d["strategies"].append(dict(d["strategies"][0])), "strategies repeat the nodes"),
    (lambda d: d["strategies"][0].update(output="S(0)RR"), "more placements than the 2 mesh axes"),
    (lambda d: d["strategies"][0].update(output=""), 'strategies with an empty placement ("")'),
    (lambda d: d["summary"].update(tensor_parallel=8), "summary disagrees with its fields on tensor_parallel"),
]


@pytest.mark.parametrize("edit,words", CASES)
def test_bad_fields_are_one_line_errors(plan_dict, tmp_path, capsys, edit, words):
    d = _copy(plan_dict)
    edit(d)
    message = _refused(_write(tmp_path, d), words, capsys)
    assert FIX in message                                          # says what to do


@pytest.mark.parametrize("dp,tp", [(-2, -2), (-1, -4)])
def test_negative_degrees_matching_the_world_are_refused(plan_dict, tmp_path, capsys, dp, tp):
    """dp * tp = 4 = the cluster's GPUs and the batch arithmetic agrees: still not a plan."""
    d = _copy(plan_dict)
    d.update(dp=dp, tp=tp, mesh_shape=[dp, tp], micro_batch_size=8 // dp)
    d["cluster"].update(gpus_per_node=4)
    d.pop("summary")
    _refused(_write(tmp_path, d), f"dp={dp} is not a positive integer", capsys)


@pytest.mark.parametrize("text,words", [
    ("[]", "a plan file holds one JSON object, not an array"),
    ("2", "a plan file holds one JSON object, not a number"),
    ('"plan"', "a plan file holds one JSON object, not a string"),
    ("null", "a plan file holds one JSON object, not null"),
    ("{}", "has no schema_version, so it is not a plan file"),
    ('{"schema_version": 1}', "invalid plan: it lacks the fields model_name, model_fingerprint"),
    ("{not json", "is not a plan JSON file (line 1 column 2: Expecting property name"),
    ("hello", "is not a plan JSON file (line 1 column 1: Expecting value)"),
    ("", "is not a plan JSON file (line 1 column 1: Expecting value)"),
    ('{"schema_version": 1, "dp": 1, "dp": 2}', 'the key "dp" appears twice in one JSON object'),
    ('{"schema_version": 1, "x": NaN}', "NaN is not a JSON number"),
    ('{"schema_version": 1, "x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"schema_version": 1, "x": 1e999}', "1e999 is too large a number for a plan file"),
    ('{"schema_version": 1, "x": ' + "9" * 5000 + "}", "a 5000-digit number is no plan value"),
    ("[" * 100000 + "]" * 100000, "nests too deeply to be a plan"),
])
def test_files_that_are_not_plans(tmp_path, capsys, text, words):
    _refused(_write(tmp_path, text=text), words, capsys)


def test_duplicate_keys_in_a_nested_object(plan_dict, tmp_path, capsys):
    text = json.dumps(plan_dict).replace('"nodes": 1,', '"nodes": 1, "nodes": 2,', 1)
    _refused(_write(tmp_path, text=text), 'the key "nodes" appears twice in one JSON object', capsys)
    with pytest.raises(ValueError, match="appears twice"):            # from_json too
        Plan.from_json(text)


def test_binary_file_and_directory(tmp_path, capsys):
    _refused(_write(tmp_path, data=bytes(range(256))), "is not a plan JSON file (binary data, not UTF-8 text", capsys)
    _refused(_write(tmp_path, data=b'{"schema_version": 1, "model_name": "\xff"}'), "binary data", capsys)
    with pytest.raises(ValueError, match="is a directory"):
        Plan.load(str(tmp_path))


def test_from_dict_and_from_json_name_the_field_too(plan_dict):
    d = _copy(plan_dict)
    d["memory"]["params_bytes"] = "x"
    for load in (lambda: Plan.from_dict(d), lambda: Plan.from_json(json.dumps(d))):
        with pytest.raises(ValueError, match=r'^invalid plan: memory\.params_bytes: "x" is not a whole number'):
            load()
    with pytest.raises(ValueError, match="the text is not JSON"):
        Plan.from_json("{")


def test_many_problems_are_counted_on_one_line(plan_dict):
    d = _copy(plan_dict)
    for k in ("dp", "tp", "pp", "global_batch", "zero_stage", "micro_batch_size"):
        d[k] = str(d[k])
    with pytest.raises(ValueError) as e:
        Plan.from_dict(d)
    assert "(and 2 more)" in str(e.value) and "\n" not in str(e.value)


def test_placements_parse_strictly():
    assert parse_placements("S(0)RP") == (Shard(0), *parse_placements("RP"))
    for bad in ("S(abc)", "S(0", "S(-1)", "X"):
        with pytest.raises(ValueError, match="placement"):
            parse_placements(bad)


# ---- strategies against the model's graph (compile_program) ---------------------------------

EMBED = "transformer.wpe|aten.embedding.default|0"      # output (32, 64); inputs: weight (32, 64), positions (32,)


def _ghosts(d):
    d["strategies"] += [dict(d["strategies"][0], key=f"ghost|aten.mm.default|{i}") for i in range(3)]


@pytest.mark.parametrize("edit,words", [
    (_ghosts, "strategies for 3 nodes the model does not have: ghost|aten.mm.default|0, "
              "ghost|aten.mm.default|1, ghost|aten.mm.default|2"),
    (lambda d: d["strategies"].pop(), "no strategy for 1 of its nodes: |aten.cross_entropy_loss.default|0"),
    (lambda d: d.update(strategies=[s for s in d["strategies"] if "ln_1" not in s["key"]]),
     "no strategy for 3 of its nodes: transformer.h.*.ln_1.weight|param|0"),
    (lambda d: _strategy(d, EMBED).update(output="S(9)R"),
     f"{EMBED} shards dim 9 of its output, which has 2 dims (shape [32, 64])"),
    (lambda d: _strategy(d, EMBED).update(inputs=["RR", "RS(1)"]),
     f"{EMBED} shards dim 1 of its input 1, which has 1 dim (shape [32])"),
    (lambda d: _strategy(d, EMBED).update(inputs=["RR"]),
     f"input placements do not match the node's tensor inputs: {EMBED} (1 for 2)"),
])
def test_strategies_that_do_not_fit_the_graph(plan_dict, graphs, tmp_path, edit, words):
    full, forward = graphs
    d = _copy(plan_dict)
    edit(d)
    d.pop("summary")
    plan = _load(d, tmp_path)                   # loads: only the graph knows its nodes and shapes
    with pytest.raises(ValueError) as e:
        compile_program(full, plan)
    message = str(e.value)
    assert message.startswith("the plan does not fit the model 'gpt-tiny': ") and "\n" not in message
    assert words in message and message.endswith("rather than editing the plan's strategies"), message
    assert FIX in message
    if "does not have" in words:                # a forward-only trace lacks the loss: not checked
        compile_program(forward, plan)


def test_graph_mismatches_are_listed_together(plan_dict, graphs):
    d = _copy(plan_dict)
    _ghosts(d)
    d["strategies"] = [s for s in d["strategies"] if "ln_2" not in s["key"]]
    d.pop("summary")
    with pytest.raises(ValueError) as e:
        compile_program(graphs[0], Plan.from_dict(d))
    assert "the model does not have: ghost" in str(e.value) and "; no strategy for 3 of its nodes" in str(e.value)
