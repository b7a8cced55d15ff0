"""The pipeline memory replay (``cost/schedule_memory.py``): action lists hand-checked for GPipe and
1F1B, the activation peak of every schedule equal to the closed form the solver uses
(``pipeline_inflight_microbatches``), and peaks hand-worked on small cases: the zero-bubble input
pass that keeps activations, the weight pass that trades them, buckets allocated whole."""
import pytest

from autopar.cost.memory import pipeline_inflight_microbatches, step_peak_bytes
from autopar.cost.schedule_memory import Chunk, activations_only, rank_actions, replay_peak_bytes
from autopar.plan import stage_rank


def test_single_stage_action_lists():
    assert rank_actions("gpipe", 2, 1, 3) == [("F", 1, 0), ("F", 1, 1), ("F", 1, 2),
                                               ("B", 1, 0), ("B", 1, 1), ("B", 1, 2)]
    # Schedule1F1B: min(m, p - r) warm-up forwards, then one backward and one forward at a time
    assert rank_actions("1f1b", 4, 3, 3) == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1),
                                              ("F", 3, 2), ("B", 3, 2)]
    assert rank_actions("1f1b", 4, 1, 4) == [("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 0), ("F", 1, 3),
                                              ("B", 1, 1), ("B", 1, 2), ("B", 1, 3)]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        rank_actions("zb2p", 2, 0, 4)


@pytest.mark.parametrize("schedule,p,v,m", [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2), ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_zb", 4, 2, 8), ("interleaved_zb", 2, 2, 2), ("zbv", 4, 2, 8), ("zbv", 4, 2, 4),
    ("dualpipev", 4, 2, 8)])
def test_activation_peak_is_the_closed_form(schedule, p, v, m):
    """Chunks of 1/v activations, no gradients, nothing held: the replay's peak is the in-flight
    count the solver's closed form gives, on every rank; every action list runs each of the rank's
    stages' m forwards and m backwards (a split one's as I + W)."""
    for r in range(p):
        acts = rank_actions(schedule, p, r, m, v)
        stages = {s for _, s, _ in acts}
        assert stages == {s for s in range(p * v) if stage_rank(schedule, p, s) == r}
        for s in stages:
            kinds = [k for k, st, _ in acts if st == s]
            assert kinds.count("F") == m and kinds.count("B") + kinds.count("W") == m
        chunks = {s: Chunk(((1.0 / v, 0.0),)) for s in stages}
        assert replay_peak_bytes(acts, chunks) == pytest.approx(pipeline_inflight_microbatches(p, r, m, schedule, v))


def test_gpipe_is_step_peak_bytes():
    """One stage, GPipe: the replay is the closed form's trade of activations for gradients."""
    pieces = ((3.0, 1.0), (5.0, 4.0), (2.0, 0.5))
    acts = rank_actions("gpipe", 2, 0, 3)
    got = replay_peak_bytes(acts, {0: Chunk(pieces)}, workspace=1.5)
    assert got == pytest.approx(step_peak_bytes(0.0, pieces, 3, 1.5, grads_during_forward=False))


def test_per_piece_workspace():
    """One stage, one micro-batch, a head (2 of activations, 1 of gradients, workspace 6) and a
    layer (4, 3, workspace 2): before the head 6 + 6 = 12, before the layer 4 + 1 + 2 = 7, at the
    end 4 + 2 = 6: 12 (a forward adds the replay's own workspace, 1 here: 7). The closed form
    agrees; one workspace of 6 for both pieces would count 4 + 1 + 6 = 11 before the layer."""
    chunk = Chunk(((2.0, 1.0), (4.0, 3.0)), workspace=(6.0, 2.0))
    acts = rank_actions("gpipe", 2, 0, 1)
    assert replay_peak_bytes(acts, {0: chunk}, workspace=1.0) == pytest.approx(12.0)
    assert step_peak_bytes(0.0, chunk.pieces, 1, 1.0, False, piece_workspace=chunk.workspace) == pytest.approx(12.0)
    late = Chunk(((2.0, 1.0), (4.0, 3.0)), workspace=(0.0, 9.0))    # the layer's is the larger
    assert replay_peak_bytes(acts, {0: late}, workspace=1.0) == pytest.approx(4.0 + 1.0 + 9.0)


def test_zero_bubble_hand_worked():
    """interleaved_zb, p = 2, v = 2, m = 2, rank 1 (stages 1 and 3):
    1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1. Stage 1: one piece (4 of activations, 3 of
    gradients), held 2; stage 3: head (2, 1) then a layer (4, 3), held 5; workspace 4.
    After 3F1: activations 2 * 4 + 2 * 6 = 20. 3I1 adds its held to 3I0's: 20 + 5 + max(4, 5) = 30,
    the peak (no gradient exists before 3W0). 3W0 (no workspace: no input gradient) trades
    stage 3's pieces: 20 + 10 at its start, 14 + 10 + 4 at its end."""
    chunks = {1: Chunk(((4.0, 3.0),), held=2.0), 3: Chunk(((2.0, 1.0), (4.0, 3.0)), held=5.0)}
    acts = rank_actions("interleaved_zb", 2, 1, 2, 2)
    assert acts == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("I", 3, 0), ("F", 3, 1), ("I", 3, 1), ("W", 3, 0),
                    ("I", 1, 0), ("W", 3, 1), ("I", 1, 1), ("W", 1, 0), ("W", 1, 1)]
    assert replay_peak_bytes(acts, chunks, workspace=4.0) == pytest.approx(30.0)
    # a larger workspace binds at the input pass instead of the held gradients: 20 + 5 + 9
    assert replay_peak_bytes(acts, chunks, workspace=9.0) == pytest.approx(34.0)
    # the activations alone (``step_memory``'s category): 20 after 3F1, each stage's own in-flight count
    assert replay_peak_bytes(acts, {s: activations_only(c) for s, c in chunks.items()}) == pytest.approx(20.0)


def test_bucket_allocated_beside_its_piece():
    """A bucket buffer exists from its piece's first gradient, beside that piece's activations:
    GPipe, one micro-batch, pieces (4, 6) then (2, 0): 6 + 6 with the bucket, against 4 + 6 at the
    boundaries of gradients that grow with the trade."""
    acts = rank_actions("gpipe", 2, 0, 1)
    assert replay_peak_bytes(acts, {0: Chunk(((4.0, 6.0), (2.0, 0.0)), bucketed=True)}) == pytest.approx(12.0)
    assert replay_peak_bytes(acts, {0: Chunk(((4.0, 6.0), (2.0, 0.0)))}) == pytest.approx(8.0)


def test_stage_output_lives_from_forward_to_backward_or_input_pass():
    """A chunk's ``output`` (the last stage's logits in torch's fwd_cache) is alive from its
    micro-batch's forward through its backward, or its input pass under a split backward, not to
    the weight pass. Hand-worked: activations 1, output 10 per micro-batch.
    1F1B order F0 B0 F1 B1: 11 at most (one output alive); F0 I0 F1 I1 W0 W1: after I0 only
    mb0's activations stay, so F1 peaks at 1 + 1 + 10 = 12 (22 if the output lived to W0);
    GPipe F0 F1 B0 B1: 2 x 11 = 22."""
    c = Chunk(((1.0, 0.0),), output=10.0)
    assert replay_peak_bytes([("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)], {0: c}) == 11.0
    split = [("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("I", 0, 1), ("W", 0, 0), ("W", 0, 1)]
    assert replay_peak_bytes(split, {0: c}) == 12.0
    assert replay_peak_bytes([("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)], {0: c}) == 22.0


def test_forward_workspace_apart():
    """A forward is charged ``forward_workspace`` (no replayed layer, nothing brought back from the
    host), a backward its pieces'. 1F1B's last stage, F0 B0 F1 B1, activations 0 (offloaded),
    gradients 3, output 2, the backward's pieces' workspace 5, the step's 8 (a replayed layer and
    a saved tensor brought back, beside a forward before): F1 beside mb0's gradients held
    3 + 2 + 8 = 13, the backward 2 + 3 + 5 = 10; with the forward's own 1: F1 3 + 2 + 1 = 6,
    so the backward's 10 is the peak."""
    c = Chunk(((0.0, 3.0),), output=2.0, workspace=(5.0,))
    acts = [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    assert replay_peak_bytes(acts, {0: c}, workspace=8.0) == 13.0
    assert replay_peak_bytes(acts, {0: c}, workspace=8.0, forward_workspace=1.0) == 10.0
