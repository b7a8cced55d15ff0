"""Distributed checkpoints (``runtime/checkpoint.py``): exact resume after a rank is killed, and a
checkpoint saved under one plan and world size loaded under others (``benchmarks/checkpoint_io.py``
runs the whole 5 x 5 matrix).

Why these bounds: a load is pure data movement (full tensors cut into another plan's shards and
gathered back), so what a resumed run saves again at the same step must be bit-identical to what
was saved, under any plan. The same plan resumed runs the same kernels in the same order on the
same values, so its losses and weights are bit-identical to the uninterrupted run. A resumed run
under another plan computes its next loss from identical weights and batches but sums in another
order: fp32 round-off, far below the 1e-5 relative the issue asks for.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import checkpoint_bodies as cb
from autopar.cli_run import reference_losses, run_command
from autopar.runtime.checkpoint import CheckpointError, latest_checkpoint, read_checkpoint
from autopar.runtime.launch import RankFailure, spawn_ranks

TINY = "gpt-tiny"
TIED = "gpt:hidden=32,layers=2,heads=2,vocab=64,seq=16,tie=1"


def _same_files(a: str, b: str) -> None:
    sa, sb = read_checkpoint(a), read_checkpoint(b)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_resume_after_a_killed_rank_is_bit_identical(tmp_path):
    """Parameters, AdamW state, the LR schedule's position and the data position all restored:
    the resumed steps are the uninterrupted run's, bit for bit."""
    force = "dp=2,tp=2,zero=2"
    whole = spawn_ranks(cb.train, 4, (TINY, force, 5, None, None, False, "adamw", None, None, True),
                        timeout_s=60)[0]
    ck = str(tmp_path / "ck")
    with pytest.raises(RankFailure):                  # rank 1 SIGKILLs itself after step 3's save
        spawn_ranks(cb.train, 4, (TINY, force, 5, ck, 1, False, "adamw", (1, 3), None, True),
                    timeout_s=20, grace_s=10)
    assert latest_checkpoint(ck).endswith("step-00000003")
    resumed = spawn_ranks(cb.train, 4, (TINY, force, 5, ck, 1, True, "adamw", None, None, True),
                          timeout_s=60)[0]
    assert resumed["first_step"] == 4 and "same plan" in resumed["resumed"]
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["lr"] == whole["lr"] == 3e-4 * 0.5 ** 5
    for k, v in whole["state"].items():
        assert torch.equal(v, resumed["state"][k]), k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at step 2 of two plans: (model, force, world) -> directory."""
    out = {}
    for model, force, world in ((TIED, "pp=2,dp=2,zero=1", 4), (TINY, "dp=2,tp=2,zero=2", 4)):
        d = str(tmp_path_factory.mktemp("saved") / "ck")
        spawn_ranks(cb.train, world, (model, force, 2, d), timeout_s=60)
        out[(model, force)] = d
    return out


@pytest.mark.parametrize("model,saved_under,load_under,world", [
    (TIED, "pp=2,dp=2,zero=1", "dp=2,zero=0", 2),        # pp=2 -> pp=1, tied weights, 4 -> 2 ranks
    (TIED, "pp=2,dp=2,zero=1", "dp=1", 1),               # -> one rank
    (TINY, "dp=2,tp=2,zero=2", "tp=2,zero=3", 2),        # tp x dp, ZeRO-2 -> tp, ZeRO-3
    # -> offloaded: the AdamW state onto host masters in NVMe files (and back out, bit for bit)
    (TINY, "dp=2,tp=2,zero=2", "dp=2,zero=1,offload=optimizer+nvme", 2),
    # -> ZeRO-3 with the parameter rows (read back for the save, written on load) and the gradients in
    # those files too
    (TINY, "dp=2,tp=2,zero=2", "dp=2,zero=3,offload=optimizer+params+nvme+nvme_params+nvme_grads", 2),
])
def test_checkpoint_loads_under_another_plan(saved, tmp_path, model, saved_under, load_under, world):
    src = str(tmp_path / "src")
    shutil.copytree(saved[(model, saved_under)], src)
    again = str(tmp_path / "again")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = spawn_ranks(cb.train, world, (model, load_under, 3, src, None, True, "adamw", None, again, False,
                                        str(nvme)), timeout_s=60)[0]
    assert not list(nvme.iterdir()), "the NVMe files outlive the run"
    assert out["first_step"] == 3 and "resharded on load" in out["resumed"]
    _same_files(os.path.join(src, "step-00000002"), again)      # the run then saved step 3 into src
    ref = reference_losses(model, 3, batch=None, seq_len=None, seed=0)
    assert out["losses"][0] == pytest.approx(ref[2], rel=1e-5)


def test_a_partial_save_never_replaces_the_last_good_one(saved, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(saved[(TINY, "dp=2,tp=2,zero=2")], d)
    os.makedirs(os.path.join(d, "step-00000003.partial"))      # a save killed before its commit
    assert latest_checkpoint(d).endswith("step-00000002")
    with open(os.path.join(d, "latest"), "w") as f:           # a pointer to a step never completed
        f.write("step-00000009\n")
    assert latest_checkpoint(d) is None
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        read_checkpoint(d)
    with open(os.path.join(d, "step-00000002", "autopar.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint(os.path.join(d, "step-00000002"))


@pytest.mark.parametrize("model,optimizer,message", [
    ("gpt:hidden=32,layers=2,heads=2,vocab=128,seq=32", "adamw", "saved for another model"),
    (TINY, "lamb", "holds AdamW state but this run's optimizer is LAMB"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(saved, model, optimizer, message):
    d = saved[(TINY, "dp=2,tp=2,zero=2")]
    with pytest.raises(RankFailure) as e:
        spawn_ranks(cb.train, 2, (model, "dp=2", 3, d, None, True, optimizer), timeout_s=30)
    assert sorted(e.value.errors) == [0, 1]
    assert all(message in m and m.startswith("CheckpointError") for m in e.value.errors.values())


def test_autopar_run_resumes_from_its_checkpoint_dir(tmp_path, capsys):
    d = str(tmp_path / "ck")
    first = run_command(TINY, nproc=2, steps=2, checkpoint_dir=d)
    assert first["first_step"] == 1 and latest_checkpoint(d).endswith("step-00000002")
    out = run_command(TINY, nproc=2, steps=3, checkpoint_dir=d, resume=True, force="tp=2")
    assert out["first_step"] == 3 and len(out["losses"]) == 1
    assert out["losses"][0] == pytest.approx(out["reference_losses"][0], rel=1e-5)
    assert "resumed step 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="give --steps > 3"):
        run_command(TINY, nproc=2, steps=3, checkpoint_dir=d, resume=True)
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        run_command(TINY, nproc=2, steps=3, resume=True)


class _Crafted:
    def __reduce__(self):
        return (os.system, ("echo crafted > /dev/null",))


def test_crafted_dcp_metadata_is_not_unpickled(saved, tmp_path):
    """DCP pickles its .metadata; autopar reads it with an unpickler that builds only DCP's classes."""
    import pickle

    d = str(tmp_path / "ck")
    shutil.copytree(saved[(TINY, "dp=2,tp=2,zero=2")], d)
    with open(os.path.join(latest_checkpoint(d), ".metadata"), "wb") as f:
        pickle.dump(_Crafted(), f)
    with pytest.raises(CheckpointError, match="names posix.system"):
        read_checkpoint(d)
