"""The Triton side of `int8_gemm.py` (imported on first use; see that file for what and why).

Two kernels compute the same `c = (a @ w^T) * a_scale * w_scale^T (+ bias)` with int8 operands and int32
accumulation (`tl.dot` on int8 lowers to Hopper's 8-bit wgmma and to Ampere/Ada's int8 mma):

- `int8_gemm_kernel`: one output tile per program, pointer loads, any M / N / K (K a multiple of 16). It runs under
  Triton's interpreter too, which is how the CPU tests check its numerics.
- `int8_gemm_tma_kernel`: persistent (one program per multiprocessor walking the tiles), operands fetched by the
  tensor memory accelerator through host-built descriptors; Hopper and later.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each weight column-tile while it is in L2."""
    in_group = GROUP_M * num_pid_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % group_rows
    pid_n = (tile_id % in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """int32 tile -> fp32 with the row (token) scale and the column (output channel) scale, then the bias."""
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        c += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return c


# M (tokens) changes with the image size and batch: not specialized (see kernels/__init__.py).
@triton.jit(do_not_specialize=["M"])
def int8_gemm_kernel(a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_am, stride_wn,
                     stride_cm, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # Rows past the end read row 0 / column 0 instead of masking every load; the store below drops them.
    a_rows = tl.where(rm < M, rm, 0).to(tl.int64)
    w_rows = tl.where(rn < N, rn, 0).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk[None, :] < K - k * BK
            a = tl.load(a_ptrs, mask=k_ok, other=0)
            w = tl.load(w_ptrs, mask=k_ok, other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
        a_ptrs += BK
        w_ptrs += BK
    c = _epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def int8_gemm_tma_kernel(a_desc, w_desc, c_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BK])
            w = w_desc.load([off_n, ki * BK])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        c = _epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
        c_desc.store([off_m, off_n], c.to(c_desc.dtype))
