"""Decode-step benchmark of the full-size Qwen-Image-2.1 architecture with random weights (GPU)."""
