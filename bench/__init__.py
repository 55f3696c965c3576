"""The benchmarks, run from the repository root of a checkout and never installed with the pack: the decode step of
every path (`python -m bench`, `runner`), prompt to PNG against diffusers' pipeline (`python -m bench --e2e`,
`e2e_runner`), and narrower ones (`python -m bench.lora`, `bench.placement`, `bench.int8_gemm`, `bench.attention8`,
`bench.multi_gpu`). Full-size models are built with random weights (`model.py`); results go to `bench/results/`."""
