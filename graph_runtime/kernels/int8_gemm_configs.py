"""Tile configurations of the INT8 GEMM per device and shape, as the GEMM benchmark found them.

`python -m bench.int8_gemm --write-table` sweeps every candidate configuration on the decode step's shapes and
writes the fastest per (compute capability, N, K, M bucket) here; the kernel only looks them up (see int8_gemm.py).
M is bucketed to the next power of two, since the token count varies with the image size.
"""

from __future__ import annotations

# {(major, minor): {(n, k, m_bucket): {GemmConfig fields}}}
TABLE: dict[tuple[int, int], dict[tuple[int, int, int], dict]] = {
    (9, 0): {
        (4096, 4096, 4096): {'kernel': 'tma', 'block_m': 128, 'block_n': 256, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (4096, 4096, 16384): {'kernel': 'tma', 'block_m': 128, 'block_n': 256, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (4096, 12288, 4096): {'kernel': 'tma', 'block_m': 256, 'block_n': 128, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (4096, 12288, 16384): {'kernel': 'tma', 'block_m': 128, 'block_n': 256, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (12288, 4096, 4096): {'kernel': 'tma', 'block_m': 256, 'block_n': 128, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (12288, 4096, 16384): {'kernel': 'tma', 'block_m': 256, 'block_n': 128, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (24576, 4096, 4096): {'kernel': 'tma', 'block_m': 128, 'block_n': 256, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
        (24576, 4096, 16384): {'kernel': 'tma', 'block_m': 256, 'block_n': 128, 'block_k': 128, 'group_m': 8, 'num_warps': 8, 'num_stages': 3},
    },
}


def m_bucket(m: int) -> int:
    bucket = 16
    while bucket < m:
        bucket *= 2
    return bucket


def lookup(capability: tuple[int, int], m: int, n: int, k: int) -> dict | None:
    """The measured config of this shape's M bucket, else of the nearest measured bucket of the same (N, K)."""
    shapes = TABLE.get(tuple(capability), {})
    bucket = m_bucket(m)
    if (n, k, bucket) in shapes:
        return shapes[(n, k, bucket)]
    measured = [b for (n_, k_, b) in shapes if (n_, k_) == (n, k)]
    if not measured:
        return None
    nearest = min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
    return shapes[(n, k, nearest)]
