"""Layers per pipeline rank: ``balance`` cuts ``total`` layers into integers that minimize the
largest affine cost (water-filling; ``timing.choose_cuts`` calls it with each rank's time and
memory per layer)."""
from __future__ import annotations

import math
from typing import Optional

_BALANCE_MEMO: dict = {}
_BALANCE_MEMO_MAX = 200_000


def balance(total: int, minimum: int, slopes, consts, caps=None) -> Optional[list]:
    """Memoized ``_balance`` (a pure function of its arguments): the search asks for the same cut
    for every ZeRO stage and data-parallel variant of a configuration."""
    key = (total, minimum, tuple(slopes), tuple(consts), None if caps is None else tuple(caps))
    hit = _BALANCE_MEMO.get(key, _BALANCE_MEMO)
    if hit is _BALANCE_MEMO:
        if len(_BALANCE_MEMO) >= _BALANCE_MEMO_MAX:
            _BALANCE_MEMO.clear()
        res = _balance(total, minimum, slopes, consts, caps)
        hit = _BALANCE_MEMO[key] = None if res is None else tuple(res)
    return None if hit is None else list(hit)


def _balance(total: int, minimum: int, slopes, consts, caps=None) -> Optional[list]:
    """Integers n_r in [minimum, caps_r] summing to ``total`` that minimize max_r slopes_r n_r + consts_r
    (None if none exist). Water-filling: the least level T with sum_r floor((T - c_r) / k_r) >= total
    (bisection), then the excess taken one layer at a time from the ranks highest above the level.
    With homogeneous layers this is the bottleneck-optimal cut of a chain into contiguous stages
    (a bottleneck shortest path over cut points would find the same, in O(pp L^2) instead).
    Ranks with equal (k, c, cap) are handled as one class, so the usual case -- the embedding's
    rank, the head's rank, the rest -- costs three terms per bisection step."""
    n = len(slopes)
    caps = list(caps) if caps is not None else [total] * n
    caps = [min(c, total - minimum * (n - 1)) for c in caps]
    if any(c < minimum for c in caps) or sum(caps) < total:
        return None
    classes: dict = {}
    for r, key in enumerate(zip(slopes, consts, caps)):
        classes.setdefault(key, []).append(r)
    keys = list(classes)
    counts = [len(classes[k]) for k in keys]

    def fill(level: float) -> list:
        res = []
        for k, c, cap in keys:
            x = cap if k <= 0 else int(math.floor((level - c) / k + 1e-9))
            res.append(max(minimum, min(cap, x)))
        return res

    def filled(ns) -> int:
        return sum(x * c for x, c in zip(ns, counts))

    if all(k <= 0 for k, _, _ in keys):
        ns = [minimum] * len(keys)
    else:
        lo = max(k * minimum + c for k, c, _ in keys)
        hi = max(k * cap + c for k, c, cap in keys)
        if filled(fill(lo)) < total:
            for _ in range(100):
                mid = (lo + hi) / 2
                if filled(fill(mid)) >= total:
                    hi = mid
                else:
                    lo = mid
                if hi - lo <= 1e-9 * max(1.0, abs(hi)):
                    break
            lo = hi
        ns = fill(lo)
    if all(k <= 0 for k, _, _ in keys):            # no cost per layer: fill in rank order
        out = [minimum] * n
        left = total - minimum * n
        for r in range(n):
            add = min(left, caps[r] - minimum)
            out[r] += add
            left -= add
        return out
    # take the excess off the ranks highest above the level: per class (value, ranks at n, ranks at n-1)
    hi_n = list(ns)
    at_hi = list(counts)
    excess = filled(ns) - total
    while excess > 0:
        i = max((j for j in range(len(keys)) if hi_n[j] > minimum and at_hi[j] > 0),
                key=lambda j: keys[j][0] * hi_n[j] + keys[j][1])
        t = min(excess, at_hi[i])
        at_hi[i] -= t
        excess -= t
        if at_hi[i] == 0:
            hi_n[i] -= 1
            at_hi[i] = counts[i]
    out = [0] * n
    for j, key in enumerate(keys):
        ranks = classes[key]
        # the ranks still at hi_n are the last at_hi of the class (higher ranks hold fewer micro-batches)
        n_lo = counts[j] - at_hi[j]
        for q, r in enumerate(ranks):
            out[r] = hi_n[j] - 1 if q < n_lo else hi_n[j]
    return out
