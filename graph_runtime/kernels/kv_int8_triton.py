"""The Triton side of `kv_int8.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl


# The row count varies with the prompt: not specialized (see kernels/__init__.py).
@triton.jit(do_not_specialize=["rows", "rows_per_batch", "dst_batch_stride"])
def dequantize_rows_kernel(src_ptr, scale_ptr, dst_ptr, rows, rows_per_batch, dst_batch_stride,
                           D: tl.constexpr, ROWS: tl.constexpr):
    """`dst[row] = src[row] * scale[row]` for ROWS rows of D values (one row: one token of one head); the
    destination's batches may be apart (the prefix rows of a `[B, P + T, H, D]` buffer)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    live = row < rows
    values = tl.load(src_ptr + row[:, None] * D + cols[None, :], mask=live[:, None], other=0).to(tl.float32)
    scale = tl.load(scale_ptr + row, mask=live, other=0.0)
    batch, within = row // rows_per_batch, row % rows_per_batch
    out = dst_ptr + batch[:, None] * dst_batch_stride + within[:, None] * D + cols[None, :]
    tl.store(out, (values * scale[:, None]).to(dst_ptr.dtype.element_ty), mask=live[:, None])
