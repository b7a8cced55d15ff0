"""Context-parallel attention (``autopar/codegen/context_attention.py``): chunk layouts, fold/unfold,
ring attention and Ulysses on gloo ranks against full-sequence SDPA (out, dq, dk, dv), input errors,
and the traffic functions against what ``CollectiveRecorder`` logs.

One 4-rank spawn runs every multi-process case: cp=4 on the world group, cp=2 on groups {0,1} and
{2,3} (the two cp=2 groups use different seeds)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.codegen.context_attention import (chunk_order, chunk_positions, fold, ring_attention,
                                               ring_traffic, ulysses_attention, ulysses_traffic, unfold)

B, H, D = 2, 4, 8

# (name, engine, cp, seq_len, order, causal, pass all_positions)
CASES = [
    ("ring4_causal_zigzag", "ring", 4, 16, "zigzag", True, False),      # all_positions inferred
    ("ring4_full_contig_odd", "ring", 4, 12, "contiguous", False, True),  # T/n = 3
    ("ring4_causal_contig_odd", "ring", 4, 12, "contiguous", True, True),  # skipped + partial blocks
    ("ring2_causal_zigzag", "ring", 2, 12, "zigzag", True, True),
    ("ring2_causal_contig_odd", "ring", 2, 10, "contiguous", True, True),  # T/n = 5
    ("ring2_full_contig", "ring", 2, 8, "contiguous", False, True),
    ("ring4_causal_one_token", "ring", 4, 4, "contiguous", True, True),    # T/n = 1
    ("ring4_causal_random", "ring", 4, 12, "random", True, True),        # any layout via all_positions
    ("uly2_causal_zigzag", "ulysses", 2, 12, "zigzag", True, True),
    ("uly2_full_contig_odd", "ulysses", 2, 10, "contiguous", False, True),
    ("uly4_causal_zigzag", "ulysses", 4, 16, "zigzag", True, True),
    ("uly2_causal_random", "ulysses", 2, 8, "random", True, True),
]
# recorded runs: (name, engine, cp, seq_len, dtype)
TRAFFIC = [("ring4_bf16", "ring", 4, 16, torch.bfloat16), ("ring2_fp32", "ring", 2, 8, torch.float32),
           ("uly4_fp32", "ulysses", 4, 16, torch.float32), ("uly2_bf16", "ulysses", 2, 8, torch.bfloat16)]


def _full(seed: int, t: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, t, D, generator=g).to(dtype) for _ in range(4)]     # q, k, v, dO


def _layout(t: int, n: int, order: str) -> list[torch.Tensor]:
    """Every cp rank's positions; "random": a seeded permutation of the sequence cut in n chunks."""
    if order == "random":
        return list(torch.randperm(t, generator=torch.Generator().manual_seed(t)).view(n, -1).unbind(0))
    return [chunk_positions(t, n, c, order) for c in range(n)]


def _run(engine, q, k, v, do, *, group, rank, n, pos, allpos, causal):
    ql, kl, vl = (x[:, :, pos].detach().requires_grad_() for x in (q, k, v))
    fn = ring_attention if engine == "ring" else ulysses_attention
    out = fn(ql, kl, vl, group=group, rank=rank, n=n, positions=pos, all_positions=allpos, causal=causal)
    out.backward(do[:, :, pos])
    return out.detach(), ql.grad, kl.grad, vl.grad


def _reference(q, k, v, do, pos, causal):
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do.float())
    return [x[:, :, pos] for x in (out.detach(), q.grad, k.grad, v.grad)]


def engines_body(rank: int, world: int) -> dict:
    """Every case on this rank: {case: {"got": [out, dq, dk, dv], "want": [...]}} and the recorded
    collectives {name: [[kind, axis, nbytes, phase], ...]}."""
    import torch.distributed as dist

    from autopar.runtime.collectives import CollectiveLog, CollectiveRecorder

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]          # every rank creates every group
    groups = {2: (pairs[rank // 2], rank % 2, (0, 1) if rank < 2 else (2, 3)), 4: (dist.group.WORLD, rank, (0, 1, 2, 3))}
    res: dict = {"cases": {}, "traffic": {}}
    for i, (name, engine, n, t, order, causal, pass_all) in enumerate(CASES):
        group, cr, _ = groups[n]
        seed = 100 * i + (rank // 2 if n == 2 else 0)
        q, k, v, do = _full(seed, t)
        layout = _layout(t, n, order)
        pos, allpos = layout[cr], (layout if pass_all else None)
        got = _run(engine, q, k, v, do, group=group, rank=cr, n=n, pos=pos, allpos=allpos, causal=causal)
        res["cases"][name] = {"got": list(got), "want": _reference(q, k, v, do, pos, causal)}
    for i, (name, engine, n, t, dtype) in enumerate(TRAFFIC):
        group, cr, ranks = groups[n]
        q, k, v, do = _full(1000 + i, t, dtype)
        pos = chunk_positions(t, n, cr, "zigzag")
        allpos = [chunk_positions(t, n, c, "zigzag") for c in range(n)]
        log = CollectiveLog()
        ql, kl, vl = (x[:, :, pos].detach().requires_grad_() for x in (q, k, v))
        fn = ring_attention if engine == "ring" else ulysses_attention
        with CollectiveRecorder(log, {"cp": ranks}):
            log.phase = "forward"
            out = fn(ql, kl, vl, group=group, rank=cr, n=n, positions=pos, all_positions=allpos, causal=True)
            log.phase = "backward"
            out.backward(do[:, :, pos])
        res["traffic"][name] = {"records": [[c.kind, c.axis, c.nbytes, c.phase] for c in log.records],
                                "got": [out.detach(), ql.grad, kl.grad, vl.grad],
                                "want": _reference(q, k, v, do, pos, True)}
    return res


@pytest.fixture(scope="module")
def engine_results():
    from autopar.runtime.launch import spawn_ranks

    return spawn_ranks(engines_body, 4, (), timeout_s=60)


def _close(got, want, what, bf16=False):
    # fp32: every value is a softmax-weighted sum of O(1) randn products over <= 16 keys and D = 8,
    # computed in a different order (blockwise + log-sum-exp merge) than SDPA; round-off is a few
    # ulps (eps 1.2e-7) times the value scale, so 1e-5 relative to the largest |value| is ~100x
    # headroom yet far below any real error (a wrong mask or a missing block moves values by O(0.1)).
    # bf16 inputs (traffic runs): the engine's output rounding is 2^-8 = 3.9e-3 relative.
    scale = max(1.0, float(want.abs().max()))
    tol = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_engine_matches_full_attention(engine_results, case):
    for rank, res in enumerate(engine_results):
        got, want = res["cases"][case]["got"], res["cases"][case]["want"]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert g.dtype == torch.float32
            _close(g, w, f"{case} rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name,engine,n,t,dtype", TRAFFIC, ids=[c[0] for c in TRAFFIC])
def test_traffic_matches_recorded(engine_results, name, engine, n, t, dtype):
    elem = torch.tensor([], dtype=dtype).element_size()
    shape = (B, H, t // n, D)
    fn = ring_traffic if engine == "ring" else ulysses_traffic
    pred = fn(shape, shape, n, elem)
    want = [[kind, "cp", nb, ph] for ph in ("forward", "backward") for kind, nb in pred[ph]]
    for rank in range(4):                              # every rank ran it (cp=2: in two groups)
        res = engine_results[rank]["traffic"][name]
        assert res["records"] == want, (rank, res["records"], want)
        for what, g, w in zip(("out", "dq", "dk", "dv"), res["got"], res["want"]):
            assert g.dtype == dtype
            _close(g, w, f"{name} rank {rank} {what}", bf16=dtype == torch.bfloat16)


def test_traffic_formulas():
    s = (2, 4, 3, 8)
    e = 2 * 4 * 3 * 8
    assert ring_traffic(s, s, 1, 4) == {"forward": [], "backward": []}
    r = ring_traffic(s, s, 3, 2)
    assert r["forward"] == [("all_to_all", 2 * e * 2)] * 2
    assert r["backward"] == [("all_to_all", 2 * e * 2), ("all_to_all", 2 * e * 4)] * 2 + [("all_to_all", 2 * e * 4)]
    u = ulysses_traffic(s, s, 2, 4)
    assert u == {"forward": [("all_to_all", 3 * e * 4), ("all_to_all", e * 4)],
                 "backward": [("all_to_all", e * 4), ("all_to_all", 3 * e * 4)]}


# ---- single process ----------------------------------------------------------------------------

def test_chunk_positions_and_order():
    assert chunk_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    assert chunk_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 2, "zigzag").tolist() == [4, 5, 6, 7]
    assert chunk_order(3, "zigzag") == [[0, 5], [1, 4], [2, 3]]
    assert chunk_order(3, "contiguous") == [[0], [1], [2]]
    for order in ("contiguous", "zigzag"):
        allpos = torch.cat([chunk_positions(24, 4, c, order) for c in range(4)])
        assert sorted(allpos.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 4"):
        chunk_positions(10, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="multiple of 3"):
        chunk_positions(10, 3, 0, "contiguous")
    with pytest.raises(ValueError, match="order"):
        chunk_positions(8, 2, 0, "striped")


def test_fold_hand_built():
    # B=4 rows, dp=2, cp=2, zigzag over T=4: rank c holds positions [c, 3-c]
    x = torch.arange(16).view(4, 4)                       # x[b, t] = 4b + t
    got = fold(x, dp=2, n=2, seq_dim=1, order="zigzag")
    want = torch.tensor([[0, 3], [4, 7],                  # d=0, c=0: rows 0,1 at positions 0,3
                         [1, 2], [5, 6],                  # d=0, c=1: positions 1,2
                         [8, 11], [12, 15],               # d=1, c=0
                         [9, 10], [13, 14]])              # d=1, c=1
    assert torch.equal(got, want)
    per_row = fold(torch.tensor([10, 11, 12, 13]), dp=2, n=2, seq_dim=None, order="zigzag")
    assert per_row.tolist() == [10, 11, 10, 11, 12, 13, 12, 13]
    contig = fold(x, dp=1, n=2, seq_dim=-1, order="contiguous")
    assert contig.tolist() == [[0, 1], [4, 5], [8, 9], [12, 13], [2, 3], [6, 7], [10, 11], [14, 15]]


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_fold_unfold_round_trip(order):
    x = torch.randn(6, 3, 12, 5)                          # B=6, seq on dim 2
    for dp, n in [(1, 2), (3, 2), (2, 3), (6, 1)]:
        y = fold(x, dp=dp, n=n, seq_dim=2, order=order)
        assert y.shape == (6 * n, 3, 12 // n, 5)
        assert torch.equal(unfold(y, dp=dp, n=n, seq_dim=2, order=order), x)
    with pytest.raises(ValueError, match="dp=4"):
        fold(x, dp=4, n=2, seq_dim=2, order=order)


def test_single_rank_engines_match():
    q, k, v, do = _full(7, 6)
    pos = torch.arange(6)
    want = _reference(q, k, v, do, pos, True)
    for engine in ("ring", "ulysses"):
        got = _run(engine, q, k, v, do, group=None, rank=0, n=1, pos=pos, allpos=[pos], causal=True)
        for g, w in zip(got, want):
            _close(g, w, engine)


def test_input_errors():
    q = torch.randn(1, 3, 4, 8)
    pos2 = [chunk_positions(8, 2, c, "contiguous") for c in range(2)]
    kw = dict(group=None, rank=0, n=2, all_positions=pos2, causal=True)
    with pytest.raises(ValueError, match="3 heads do not split over cp=2"):
        ulysses_attention(q, q, q, positions=pos2[0], **kw)
    with pytest.raises(ValueError, match="hold 4 tokens but positions has 3"):
        ring_attention(q, q, q, positions=torch.arange(3), **{**kw, "all_positions": None})
    with pytest.raises(ValueError, match="must have q's shape"):
        ring_attention(q, q[:, :, :3], q, positions=pos2[0], **kw)
    with pytest.raises(ValueError, match="cover 0..7"):
        ring_attention(q, q, q, positions=pos2[0], **{**kw, "all_positions": [pos2[0], pos2[0]]})
    with pytest.raises(ValueError, match="neither a contiguous nor a zig-zag"):
        ring_attention(q, q, q, positions=torch.tensor([0, 2, 4, 6]), **{**kw, "all_positions": None})


# ---- the flash-kernel blocks (one process) -----------------------------------------------------

def test_zigzag_blocks_split_into_kernel_pieces():
    """Rank 0 of cp=2 holds pieces 0 and 3 of 4 (of 2 tokens each): against its own K/V the
    pieces attend as diagonal, full (3 after 0) and diagonal; against rank 1's pieces 1 and 2,
    piece 0 sees nothing and piece 3 sees both in full. Keys that start inside a query run without
    being it are no kernel shape (the masked math runs them)."""
    from autopar.codegen.context_attention import _pairs, chunk_positions

    p0, p1 = chunk_positions(8, 2, 0, "zigzag"), chunk_positions(8, 2, 1, "zigzag")
    assert p0.tolist() == [0, 1, 6, 7] and p1.tolist() == [2, 3, 4, 5]
    own = [(q.start, q.stop, k.start, k.stop, diag) for q, k, diag in _pairs(p0, p0, True)]
    assert own == [(0, 2, 0, 2, True), (2, 4, 0, 2, False), (2, 4, 2, 4, True)]
    other = [(q.start, q.stop, k.start, k.stop, diag) for q, k, diag in _pairs(p0, p1, True)]
    assert other == [(2, 4, 0, 4, False)]
    assert _pairs(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2]), True) is None
    assert _pairs(p0, p1, False) == [(slice(None), slice(None), False)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_flash_blocks_with_global_statistics_give_the_whole_gradients(device):
    """Per key block, the flash op's backward with the WHOLE attention's output and lse adds up to
    the whole attention's gradients (what the ring relies on); forward blocks merged by
    log-sum-exp give the whole output. fp32 on CPU (bound: fp32 round-off of sums of 16 terms),
    bf16 on CUDA (bound: a few bf16 ulps of the largest entry)."""
    from autopar.codegen.context_attention import _flash, _flash_backward, _flash_forward, _merge

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)
    do = torch.randn(ref.shape, generator=g).to(device, dtype)
    ref.backward(do)
    kind, scale = _flash(q), 0.25
    assert kind == device
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full(q.shape[:3], float("-inf"), device=device)
    blocks = (slice(0, 4), slice(4, 8))
    for ks in blocks:
        _merge(out, lse, slice(None), *_flash_forward(kind, q.detach(), k.detach()[:, :, ks], v.detach()[:, :, ks],
                                                      False, scale))
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref.float()).abs().max() <= rtol * ref.float().abs().max()
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    for ks in blocks:
        a, b, c = _flash_backward(kind, do, q.detach(), k.detach()[:, :, ks], v.detach()[:, :, ks],
                                  out.to(dtype), lse, False, scale)
        dq += a.float()
        dk[:, :, ks] += b.float()
        dv[:, :, ks] += c.float()
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (got - want.float()).abs().max() <= rtol * want.float().abs().max()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
    """Every cp rank's queries see the same number of keys under the causal mask with the zig-zag
    layout (the planner costs causal attention as evenly split); contiguous chunks do not."""
    t = 16 * n

    def work(order):
        pos = [chunk_positions(t, n, r, order) for r in range(n)]
        return [int(sum((p + 1).tolist())) for p in pos]          # query at position i sees i + 1 keys

    assert len(set(work("zigzag"))) == 1 and sum(work("zigzag")) == t * (t + 1) // 2
    assert len(set(work("contiguous"))) == n
