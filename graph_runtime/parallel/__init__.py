"""Decoding one request on several devices: Ulysses sequence parallelism and CFG parallelism over
torch.distributed, each rank replaying its own captured graphs. docs/multi-gpu.md explains it."""
