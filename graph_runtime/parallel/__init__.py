"""Decoding one request on several devices: Ulysses sequence parallelism and CFG parallelism over
torch.distributed, each rank replaying its own captured graphs (docs/multi-gpu.md).

`sample_on_devices` is the face: the sampling loop on one device, or on `gpus` ranks (rank 0 in this process, one
worker process per further device, kept between prompts). `check_gpus` judges the count a user asked for.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .runtime import MAX_DEVICES, ParallelFailure

GPUS_HELP = ("How many devices the KV-Graph sampler decodes each image on: 1 (default) runs on one; N > 1 starts N-1 "
             "worker processes beside this one, which split the image's tokens (sequence parallelism) and, with "
             "CFG, the two branches. On CUDA it needs N GPUs visible to this process; on a CPU-only machine N > 1 "
             "means N CPU processes (for tests). The count must divide the transformer's attention heads (32: 1, 2, "
             "4, 8). Core samplers on the MODEL output decode on one GPU.")


def check_gpus(gpus, device=None) -> int:
    """`gpus` as a count this machine can run (the heads are checked when the model is known)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_DEVICES:
        raise InputError("gpus", gpus, f"a whole number from 1 to {MAX_DEVICES}")
    if device is not None and torch.device(device).type == "cuda" and gpus > 1:
        count = torch.cuda.device_count()
        if gpus > count:
            raise InputError("gpus", gpus, f"at most {count}: the number of CUDA GPUs this process sees (each rank "
                                           "needs its own GPU)")
    return gpus


def sample_on_devices(loaded, request, gpus: int = 1, on_step=None, should_stop=None, on_event=None):
    """The sampling loop for `request` on `gpus` devices of the loaded model (graph_runtime/loaded.py; 1: its own
    engine, as `sampling.sample`)."""
    from ..sampling.sampler import sample

    if gpus == 1:
        return sample(loaded.engine, request, on_step, should_stop, on_event)
    from ..errors import InputError

    if request.control is not None:
        raise InputError("gpus", gpus, "1 with a ControlNet (its stream is not split over several GPUs yet)")
    if request.step_cache is not None:
        # Every rank would decide on its own whether to skip; one that decided otherwise would wait forever in the
        # step's collectives.
        raise InputError("step cache", "with gpus > 1", "gpus 1 (the step cache runs on one device for now)")
    return loaded.parallel_runtime(gpus).sample(request, on_step, should_stop, on_event)


__all__ = ["GPUS_HELP", "ParallelFailure", "check_gpus", "sample_on_devices"]
