"""The e4m3 row-quantization constants, shared by the PyTorch reference (fp8_quant.py) and the Triton kernels
(fp8_quant_triton.py, norm_modulate_triton.py) without either importing the other."""

FP8_MAX = 448.0  # e4m3's largest finite value
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero
