"""GGUF block dequantization in torch, so a GGUF load dequantizes on the GPU where there is one (the gguf package's
numpy dequantizers run on the CPU only: minutes for a 7 B model's K-quants).

Each function follows the block layout of the matching `gguf.quants` dequantizer, with the same float32 operations
in the same order, so its result equals gguf's bit for bit (the tests check every type against it). The float types
are only cast, and the types without a port here (the IQ and ternary types, MXFP4) are dequantized by gguf on the
CPU (gguf_files.py).
"""

from __future__ import annotations

import torch

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, k*width] bytes -> [n, k, 2, width] (low nibbles, then high nibbles, of each run of `width` bytes)."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (qs.reshape(n, -1, 1, width) >> shifts) & 0x0F


def _bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """Four bytes per block as 32 one-bit values, bit i of the little-endian word first."""
    shifts = torch.arange(32, dtype=torch.int32, device=qh.device).reshape(1, 32)
    word = qh.contiguous().view(torch.int32).reshape(n, 1)
    return ((word >> shifts) & 1).to(torch.uint8)


def q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b[:, :2])


def q4_0(b):
    qs = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(b[:, :2]) * qs.to(torch.float32)


def q4_1(b):
    qs = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).to(torch.float32)
    return _f16(b[:, :2]) * qs + _f16(b[:, 2:4])


def _q5(b, offset):
    n = b.shape[0]
    qh = _bits(b[:, offset:offset + 4], n)
    ql = _nibbles(b[:, offset + 4:], 16).reshape(n, -1)
    return ql | (qh << 4)


def q5_0(b):
    qs = _q5(b, 2).to(torch.int8) - 16
    return _f16(b[:, :2]) * qs.to(torch.float32)


def q5_1(b):
    return _f16(b[:, :2]) * _q5(b, 4).to(torch.float32) + _f16(b[:, 2:4])


def q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, -1, 1, 32) >> shift) & 3).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, -1)


def q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device)
           .reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
            .reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
          .reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device)
          .reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # the offset is 4 where the mask bit is 0
    return (dl * q.to(torch.float32)).reshape(n, QK_K)


def _scale_min(scales: torch.Tensor):
    """Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def q4_k(b):
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, -1, 1)
    qs = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).to(torch.float32)
    return (d * qs - dm).reshape(n, QK_K)


def q5_k(b):
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, -1, 1)
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = _nibbles(qs, 32).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1))
            & 1).reshape(n, -1, 32)
    q = (ql | (high << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def q6_k(b):
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = (_f16(b[:, 208:210]) * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
             .reshape(1, 1, 4, 1)) & 3).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, -1).to(torch.float32)).reshape(n, QK_K)


# type name: (values per block, bytes per block, dequantizer)
PORTS = {
    "Q8_0": (32, 34, q8_0), "Q4_0": (32, 18, q4_0), "Q4_1": (32, 20, q4_1), "Q5_0": (32, 22, q5_0),
    "Q5_1": (32, 24, q5_1), "Q2_K": (QK_K, 84, q2_k), "Q3_K": (QK_K, 110, q3_k), "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k), "Q6_K": (QK_K, 210, q6_k),
}
def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of a type in PORTS as float32 values from its raw bytes (a uint8 tensor on any device), in `shape`."""
    raw = raw.reshape(-1)
    _, size, port = PORTS[type_name]
    return port(raw.reshape(-1, size)).reshape(shape)
