"""Tile configurations of the INT8 GEMM per device and shape, as the GEMM benchmark found them.

`python -m bench.int8_gemm --write-table` sweeps every candidate configuration on the decode step's shapes and
writes the fastest per (compute capability, N, K, M bucket) here; the kernel only looks them up (see int8_gemm.py).
M is bucketed to the next power of two, since the token count varies with the image size.
"""

from __future__ import annotations

# {(major, minor): {(n, k, m_bucket): {GemmConfig fields}}}
TABLE: dict[tuple[int, int], dict[tuple[int, int, int], dict]] = {}


def m_bucket(m: int) -> int:
    bucket = 16
    while bucket < m:
        bucket *= 2
    return bucket


def lookup(capability: tuple[int, int], m: int, n: int, k: int) -> dict | None:
    return TABLE.get(tuple(capability), {}).get((n, k, m_bucket(m)))
