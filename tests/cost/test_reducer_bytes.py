"""The gradient reducer's transient bytes (``cost/memory.py``: ``reducer_transient_bytes``,
``reducer_end_bytes``) against hand-worked cases of the buffers ``runtime/reducer.py`` holds
(measured against runs in ``tests/runtime/test_memory_measure.py`` and ``test_reducer_memory.py``).
Units are arbitrary: G gradient bytes, B the bucket, A the activations at the peak."""
from __future__ import annotations

import pytest

from autopar.cost.memory import reducer_end_bytes, reducer_transient_bytes


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
