"""True CFG with a negative carrying other reference images, on a CUDA GPU: each branch's prefix (of its own length)
owns its own graph entry, every step of both branches replays, and the latents equal an eager run.

Run on the H200:

    python -m pytest -m gpu tests/gpu/test_gpu_cfg_references.py

The tiny model runs in fp32: a replayed step differs from an eager one by fp32 round-off (1e-5 on values ~1-5,
tests/gpu/test_gpu_decode.py), carried through 4 CFG steps at cfg 4: 1e-4.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
H = W = 8


def test_both_branches_replay_with_their_own_references(cuda_models, reference_image):
    from graph_runtime.decode import DecodeEngine
    from graph_runtime.encoding.images import encode_pixels, prepare_references
    from graph_runtime.encoding.prompt import PromptEncoder
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    transformer = cuda_models.transformer.float()
    encoder = PromptEncoder(cuda_models.text_encoder.float(), cuda_models.processor)
    ref = prepare_references([reference_image], 128)[0]
    positive = encoder.encode("make the sky purple", [ref.vision_image])
    negative = encoder.encode("blurry")  # no image: a shorter prefix, another graph entry
    latent = encode_pixels(cuda_models.vae.float(), ref.vae_pixels)

    def run(engine, mode, negative_refs):
        request = SamplingRequest(positive=positive, negative=negative, cfg=4.0, reference_latents=[latent],
                                  negative_reference_latents=negative_refs, latent_height=H, latent_width=W,
                                  steps=4, seed=1, decode_mode=mode, scheduler_config=cuda_models.scheduler_config)
        return sample(engine, request)

    engine = DecodeEngine(transformer)
    graphs = run(engine, "graph", [])
    assert set(graphs.paths) <= {"capture", "replay"} and graphs.paths.count("capture") == 2
    eager = run(DecodeEngine(transformer), "eager", [])
    assert (graphs.latents - eager.latents).abs().max().item() <= 1e-4
    again = run(engine, "graph", [])
    assert set(again.paths) == {"replay"}
