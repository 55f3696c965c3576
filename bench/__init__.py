"""Benchmarks of the full-size Qwen-Image-2.1 architecture with random weights (GPU): the decode step (`runner`)
and prompt to PNG against diffusers' pipeline (`e2e_runner`)."""
