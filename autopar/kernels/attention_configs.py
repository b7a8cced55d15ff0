"""Launch configs of the attention kernels (autopar/kernels/attention.py): the autotuned tile lists, the
fixed tiles tests pass instead (``AttentionBlocks``), and where the TMA descriptors are built
(``descriptor_mode``, AUTOPAR_ATTENTION_DESC)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import triton
from triton.tools.tensor_descriptor import TensorDescriptor

DESC_ENV = "AUTOPAR_ATTENTION_DESC"
DESC_MODES = ("host", "device")


def descriptor_mode() -> str:
    """How the kernels get their TMA descriptors: "host" (the default: built by the launcher,
    ``TensorDescriptor``) or "device" (built inside the kernels, ``tl.make_tensor_descriptor``),
    from the environment variable AUTOPAR_ATTENTION_DESC, read at every launch (unset or empty:
    "host"). See the module docstring for why both exist."""
    mode = os.environ.get(DESC_ENV, "").strip() or "host"
    if mode not in DESC_MODES:
        raise ValueError(f"{DESC_ENV}={os.environ[DESC_ENV]!r} is not a descriptor mode; use one "
                         f"of {DESC_MODES} (unset means 'host')")
    return mode


# --------------------------------------------------------------------------------------------
# Launch configs
# --------------------------------------------------------------------------------------------


def _size_boxes(nargs):
    """Config pre_hook (the tutorial's _tma_pre_hook): the host descriptors' TMA boxes follow the
    config's tiles, BLOCK_M rows of q / dO and BLOCK_N rows of k / v. On the device path the
    desc_* arguments are plain tensors (the kernels size their boxes) and are left alone."""
    for name, block in (("desc_q", "BLOCK_M"), ("desc_do", "BLOCK_M"),
                        ("desc_k", "BLOCK_N"), ("desc_v", "BLOCK_N")):
        if isinstance(nargs.get(name), TensorDescriptor):
            nargs[name].block_shape = [1, nargs[block], nargs["HEAD_D"]]


def _config(block_m, block_n, warps, stages):
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps,
                         num_stages=stages, pre_hook=_size_boxes)


# Every list starts with the tiles used before the lists existed (the interpreter runs that one)
# and adds the tutorial's Hopper configs that build for sm_90a without spills at D=64 and D=128;
# a config that runs out of shared memory on some Triton version is skipped by the autotuner.
# Forward: BLOCK_M queries per program, BLOCK_N keys per iteration (BLOCK_M % BLOCK_N == 0 keeps
# the diagonal on whole key blocks).
FWD_CONFIGS = (
    _config(128, 64, 8, 3),
    _config(128, 128, 8, 3),  # the tutorial's Hopper (TMA) tile: 225 KB of shared memory at D=128
    _config(128, 128, 8, 2),  # ... with one stage less (161 KB)
    _config(128, 64, 4, 3),  # the tutorial's 4-warp tiles (one warpgroup per 128 rows)
)
# dK/dV: BLOCK_N keys per program, BLOCK_M queries per iteration (BLOCK_N % BLOCK_M == 0). Keyed by
# the largest head dim a list serves: the dK and dV accumulators (BLOCK_N x D fp32 each) leave no
# room for 128 keys per program at D=128 on 4 warps (kilobytes of spills), and the tutorial's
# 32 x 128 tile also appears with 8 warps. 128 keys at D=128 on 8 warps and the tutorial's own
# 32 x 128 on 4 warps (5 stages) at D=64 were first left out because builds without the alignment
# attributes real launches have showed spills (116 and 140 bytes); built as launched
# (sm90_build.py) neither spills (197 to 254 and 236 to 244 registers), so both are in.
DKDV_CONFIGS = {
    64: (
        _config(64, 128, 8, 3),
        _config(32, 128, 8, 3),
        _config(32, 64, 4, 5),  # the tutorial's 4 warps and 5 stages
        _config(64, 64, 4, 3),
        _config(32, 128, 4, 5),  # the tutorial's dK/dV tile, warps and stages
    ),
    128: (
        _config(32, 64, 4, 3),
        _config(32, 64, 4, 5),
        _config(64, 64, 4, 3),
        _config(32, 128, 8, 3),
    ),
}
# dQ: BLOCK_M queries per program, BLOCK_N keys per iteration (BLOCK_M % BLOCK_N == 0).
DQ_CONFIGS = (
    _config(128, 32, 8, 3),
    _config(128, 32, 4, 5),  # the tutorial's dQ tile, warps and stages
    _config(128, 64, 8, 3),
)


@dataclass(frozen=True)
class AttentionBlocks:
    """Fixed tiles and warps in place of the tuned lists (tests use small ones so that short
    sequences cross several blocks); the defaults are the lists' first configs at D=128.
    fwd_m % fwd_n == 0, bwd_kv_n % bwd_kv_m == 0 and bwd_q_m % bwd_q_n == 0 keep the diagonal
    aligned to whole blocks; all are powers of two >= 16."""

    fwd_m: int = 128  # query rows per forward program
    fwd_n: int = 64  # keys per forward iteration
    fwd_warps: int = 8
    bwd_kv_n: int = 64  # keys per dK/dV program
    bwd_kv_m: int = 32  # queries per dK/dV iteration
    bwd_kv_warps: int = 4
    bwd_q_m: int = 128  # queries per dQ program
    bwd_q_n: int = 32  # keys per dQ iteration
    bwd_q_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        sizes = (self.fwd_m, self.fwd_n, self.bwd_kv_n, self.bwd_kv_m, self.bwd_q_m, self.bwd_q_n)
        if any(s < 16 or s & (s - 1) for s in sizes):
            raise ValueError(f"AttentionBlocks: tile sizes {sizes} must be powers of two >= 16")
        if self.fwd_m % self.fwd_n or self.bwd_kv_n % self.bwd_kv_m or self.bwd_q_m % self.bwd_q_n:
            raise ValueError(f"AttentionBlocks: need fwd_m % fwd_n == 0, bwd_kv_n % bwd_kv_m == 0, "
                             f"bwd_q_m % bwd_q_n == 0; got {sizes}")

    def configs(self):
        """(forward, dK/dV, dQ) launch configs."""
        s = self.num_stages
        return (_config(self.fwd_m, self.fwd_n, self.fwd_warps, s),
                _config(self.bwd_kv_m, self.bwd_kv_n, self.bwd_kv_warps, s),
                _config(self.bwd_q_m, self.bwd_q_n, self.bwd_q_warps, s))
