"""The Triton side of `silu_mul.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl


@triton.jit
def silu_mul_fp32(gate_ptr, up_ptr, offsets, mask):
    """`silu(gate) * up` in fp32 at `offsets` (masked lanes 0): the SwiGLU product every MLP kernel starts from,
    whether it stores it as is or quantizes its row."""
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


# The element count varies with the prompt and image size: not specialized (see kernels/__init__.py).
@triton.jit(do_not_specialize=["n"])
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # int64 offsets: a large batch at a large size may pass 2^31 elements, where int32 offsets would wrap.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, silu_mul_fp32(gate_ptr, up_ptr, offsets, mask).to(out_ptr.dtype.element_ty),
             mask=mask)
