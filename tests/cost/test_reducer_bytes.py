"""The gradient reducer's transient bytes (``cost/memory.py``: ``reducer_transient_bytes``,
``reducer_end_bytes``) against hand-worked cases of the buffers ``runtime/reducer.py`` holds
(measured against runs in ``tests/runtime/test_memory_measure.py`` and ``test_reducer_memory.py``).
Units are arbitrary: G gradient bytes, B the bucket, A the activations at the peak."""
from __future__ import annotations

import pytest

from autopar.cost.memory import reducer_end_bytes, reducer_piece_transients, reducer_transient_bytes


def test_end_of_the_reduction_by_hand():
    assert reducer_end_bytes(10, 2, 0, 25) == 0                   # ZeRO-0 reduces in place
    assert reducer_end_bytes(10, 1, 2, 25) == 0                   # nothing to reduce over one rank
    # one bucket (G < B): its summands and send buffer, less the output not made yet: 10 (2 - 1/2)
    assert reducer_end_bytes(10, 2, 2, 25) == pytest.approx(15)
    # the rows of earlier micro-batches beside it (ZeRO 2/3 reducing each micro-batch): + G / 2
    assert reducer_end_bytes(10, 2, 2, 25, accumulating=True) == pytest.approx(20)
    # four buckets over 4 ranks: the last one's 25 (2 - 1/4) and the previous send buffer's 25
    assert reducer_end_bytes(100, 4, 2, 25) == pytest.approx(68.75)
    assert reducer_end_bytes(100, 4, 1, 25) == reducer_end_bytes(100, 4, 3, 25)


def test_transient_by_hand():
    # ZeRO-2, four buckets: during the backward one bucket in flight and one filling (50), at the
    # end 68.75 beside what is left of the activations
    assert reducer_transient_bytes(100, 4, 2, 25, activation_bytes=10) == pytest.approx(58.75)
    assert reducer_transient_bytes(100, 4, 2, 25, activation_bytes=40) == pytest.approx(50)
    assert reducer_transient_bytes(100, 4, 0, 25) == 0
    # ZeRO-1: the plan counts one whole copy G; at the end the rows (G / 2) and the last bucket's
    # buffers (15) exceed it and the freed activations by 15 + 5 - 10 - 4 = 6 for a small model ...
    assert reducer_transient_bytes(10, 2, 1, 25, activation_bytes=4) == pytest.approx(6)
    assert reducer_transient_bytes(10, 2, 1, 25, activation_bytes=20) == 0
    # ... never for one with several buckets: 68.75 + 25 - 100 < 0
    assert reducer_transient_bytes(100, 4, 1, 25) == 0


def test_piece_by_piece_by_hand():
    # ZeRO-2 over 2 ranks, buckets of 25 after a first of 1: summands 10 per piece, 60 in all ->
    # buckets 1, 25, 25, 9 ending at 1, 26, 51, 60. Per piece, (beside its workspace: the open
    # bucket's summands, the previous send buffer and the launched buckets' rows at its start; at
    # a launch in it: 2 b_i + b_(i-1) + the rows before), with gradient offload (the rows leave):
    off = reducer_piece_transients([10] * 6, 2, 2, 25, 1, rows_kept=False)
    # piece 1 launches the first bucket (2 x 1); piece 2 starts with 9 open + 1 in flight + its
    # output 0.5, piece 3 with 19 + 1.5 and launches the second (2 x 25 + 1.5); pieces 4, 5, 6
    # start with 4, 14, 24 open + 25 x 1.5 in flight; piece 6 launches the third (2 x 25 + 37.5),
    # and the last, whose launch ends the backward (``reducer_end_bytes``: not here)
    assert off == [pytest.approx(x) for x in [(0, 2), (10.5, 0), (20.5, 51.5), (41.5, 0), (51.5, 0), (61.5, 87.5)]]
    # the rows kept: the caller counts half of the summands before each piece as rows (5 before
    # piece 2, ...), where only the launched buckets' exist (0.5 of the first; 13 once the second
    # is out): piece 2 10.5 - 5, piece 3 20.5 - 10 and its launch 51.5 - 10, piece 4 (4 + 25 + 13)
    # - 15, piece 5 52 - 20, piece 6 62 - 25 and its launch (2 x 25 + 25 + 13) - 25
    kept = reducer_piece_transients([10] * 6, 2, 2, 25, 1)
    assert kept == [pytest.approx(x) for x in [(0, 2), (5.5, 0), (10.5, 41.5), (27, 0), (32, 0), (37, 63)]]
    # a third of each piece's own summands made before its widest op: piece 2 at 10 + 10/3
    assert reducer_piece_transients([10] * 6, 2, 2, 25, 1, rows_kept=False, own=1 / 3)[1] == \
        pytest.approx((10 + 10 / 3 - 1 + 1.5, 0))
    # ZeRO-1 (``reducer_transient_bytes``) and one rank: nothing
    assert reducer_piece_transients([10] * 6, 2, 1, 25, 1) == reducer_piece_transients([10] * 6, 1, 3, 25, 1) == \
        [(0.0, 0.0)] * 6


def test_send_buffers_in_sixteen_bits_by_hand():
    # mixed precision reduces fp32 summands through bf16 send buffers (wire 1/2): one bucket of 10
    # over 2 ranks at the end: its summands 10 + a send buffer of 5 - the output's 5 not made yet
    assert reducer_end_bytes(10, 2, 2, 25, wire=0.5) == pytest.approx(10)
    # four buckets over 4 ranks: 25 (1 + 1/2 - 1/4) + the previous send buffer's 12.5
    assert reducer_end_bytes(100, 4, 2, 25, wire=0.5) == pytest.approx(43.75)
    # during the backward: a send buffer of 12.5 in flight and 25 filling
    assert reducer_transient_bytes(100, 4, 2, 25, activation_bytes=40, wire=0.5) == pytest.approx(37.5)
    # piece by piece (as ``test_piece_by_piece_by_hand``, rows offloaded): piece 1's launch
    # 1.5 x 1; piece 3 starts with 19 open + the first's 0.5 in flight + its output 0.5, and its
    # launch holds 1.5 x 25 + 1; piece 6 starts with 24 open + the second's 25 x (1/2 + 1/2), and
    # its launch holds 1.5 x 25 + 25
    off = reducer_piece_transients([10] * 6, 2, 2, 25, 1, rows_kept=False, wire=0.5)
    assert off[0] == pytest.approx((0, 1.5))
    assert off[2] == pytest.approx((20, 38.5))
    assert off[5] == pytest.approx((24 + 25, 37.5 + 25))
