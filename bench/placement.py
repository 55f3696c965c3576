"""`python -m bench.placement`: what each text-encoder placement costs, timed on the GPU.

A full-size Qwen3-VL-8B text encoder (its published dimensions, random bf16 weights built on the GPU; nothing is
downloaded) is moved to and from the GPU the two ways the pack can:

- pageable: `module.to("cpu")` and `module.to("cuda")`, what a plain offload does;
- pinned: `PinnedWeights` (graph_runtime/placement.py), one page-locked host copy; `load` copies from it, `offload`
  drops the GPU copy without copying anything back.

It also times one encode of a short prompt on the GPU, so a changed prompt's whole cost under each placement can be
read off, checks that the weights come back bit-equal, and writes markdown and JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from graph_runtime.placement import PinnedWeights

PROMPT = "A capybara wearing a wizard hat, reading a book by candlelight, oil painting"


def text_encoder_8b_config():
    """Qwen3-VL-8B's published dimensions. ComfyUI's qwen3vl_8b_bf16.safetensors has no lm_head, so the head is
    tied to the embeddings, as the loader does: 8.15 B parameters, 16.3 GB in bf16."""
    from transformers import Qwen3VLConfig

    from graph_runtime.loading.config_infer import (
        IMAGE_TOKEN_ID, QWEN3VL_MAX_POSITIONS, QWEN3VL_ROPE_THETA, VIDEO_TOKEN_ID, VISION_END_TOKEN_ID,
        VISION_START_TOKEN_ID, deepstack_indexes, mrope_section_for_head_dim,
    )
    from graph_runtime.tiny import QWEN_VOCAB_SIZE

    return Qwen3VLConfig(
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=QWEN_VOCAB_SIZE,
                         max_position_embeddings=QWEN3VL_MAX_POSITIONS, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": QWEN3VL_ROPE_THETA,
                                          "mrope_section": mrope_section_for_head_dim(128),
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           deepstack_visual_indexes=deepstack_indexes(27, 3), num_position_embeddings=2304,
                           in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID, tie_word_embeddings=True,
    )


def build_text_encoder(device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """The full-size text encoder with random weights, built directly on `device` (transformers' own init)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(text_encoder_8b_config())
    finally:
        torch.set_default_dtype(saved)
    return model.eval().requires_grad_(False)


def _timed(fn, device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _fingerprint(module) -> list[torch.Tensor]:
    """A cheap record of the values: each tensor's bytes summed (on the GPU), and full copies of the three
    largest tensors (the embedding table and two MLP weights), compared exactly."""
    tensors = [*module.parameters(), *module.buffers()]
    sums = [t.detach().view(torch.uint8).sum(dtype=torch.int64) for t in tensors]
    largest = sorted(tensors, key=lambda t: t.numel(), reverse=True)[:3]
    return sums + [t.detach().clone() for t in largest]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def measure(device="cuda", repeats: int = 3) -> dict:
    from graph_runtime.encoding.prompt import PromptEncoder
    from graph_runtime.memory import module_bytes
    from graph_runtime.tiny import build_processor

    device = torch.device(device)
    module = build_text_encoder(device)
    nbytes = module_bytes(module)
    expected = _fingerprint(module)
    encoder = PromptEncoder(module, build_processor())
    encoder.encode(PROMPT, device=device)  # warm-up: kernels, cuBLAS handles
    encode_s = min(_timed(lambda: encoder.encode(PROMPT, device=device), device) for _ in range(repeats))

    to_cpu_s = _timed(lambda: module.to("cpu"), device)  # pageable: each tensor copied into fresh host memory
    to_gpu_s = _timed(lambda: module.to(device), device)
    start = time.perf_counter()
    placement = PinnedWeights(module, device)  # packs the GPU tensors into one pinned host buffer
    torch.cuda.synchronize(device)
    adopt_s = time.perf_counter() - start
    if placement.fallback_reason is not None:
        raise RuntimeError(f"pinned placement unavailable: {placement.fallback_reason}")
    loads, offloads = [], []
    for _ in range(repeats):
        loads.append(_timed(placement.load, device))
        offloads.append(_timed(placement.offload, device))
    placement.load()
    equal = _same(expected, _fingerprint(module))
    pinned_encode_s = _timed(lambda: encoder.encode(PROMPT, device=device), device)
    whole = encoder.encode(PROMPT, device=device).embeds
    placement.offload()
    streamed = _streamed(module, encoder, placement, device, repeats)
    streamed["streamed_bit_equal"] = torch.equal(whole, streamed.pop("embeds"))
    gb = nbytes / 1e9
    return {
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "bytes": nbytes,
        "pinned": placement.pinned, "host_bytes": placement.host_bytes,
        "encode_s": encode_s, "encode_after_pinned_load_s": pinned_encode_s,
        "pageable_to_cpu_s": to_cpu_s, "pageable_to_gpu_s": to_gpu_s, "pin_from_gpu_s": adopt_s,
        "pinned_load_s": statistics.median(loads), "pinned_offload_s": statistics.median(offloads),
        "pinned_loads_s": loads, "pinned_offloads_s": offloads,
        "pageable_to_gpu_gb_s": gb / to_gpu_s, "pageable_to_cpu_gb_s": gb / to_cpu_s,
        "pinned_load_gb_s": gb / statistics.median(loads), "bit_equal_after_round_trips": equal, **streamed,
    }


def _streamed(module, encoder, placement, device, repeats: int) -> dict:
    """One encode streamed by layer from the pinned copy (graph_runtime/layer_stream.py): its time (the uploads
    included), its peak GPU memory above what was allocated before, and the plan's figure for it."""
    from graph_runtime.encoding.streamed import streamed_by_layer
    from graph_runtime.memory import plan as plans

    def run():
        with streamed_by_layer(module, device, placement):
            return encoder.encode(PROMPT, device=device).embeds

    run()  # warm-up: the copy stream, the allocator's pool for it
    seconds = min(_timed(run, device) for _ in range(repeats))
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    embeds = run()
    peak = torch.cuda.max_memory_allocated(device) - base
    size = plans.TextEncoderSize.of(module)
    return {"streamed_encode_s": seconds, "streamed_peak_bytes": peak,
            "streamed_plan_bytes": size.gpu_bytes(plans.TE_STREAMED, encoder.token_bound(PROMPT)),
            "streamed_outside_bytes": size.outside_bytes, "streamed_layer_bytes": size.layer_bytes, "embeds": embeds}


def markdown(result: dict, command: str, date: str) -> str:
    gb = result["bytes"] / 1e9
    per_prompt = {
        "gpu while encoding, then offload (pinned copy)":
            result["pinned_load_s"] + result["encode_s"] + result["pinned_offload_s"],
        "same, pageable moves (no pinned copy)":
            result["pageable_to_gpu_s"] + result["encode_s"] + result["pageable_to_cpu_s"],
        "always gpu": result["encode_s"],
        "streamed by layer (pinned copy, uploads overlapped)": result["streamed_encode_s"],
    }
    lines = [
        f"# Text-encoder placement, {date}", "",
        f"- GPU: {result['gpu']}; torch {result['torch']}; command: `{command}`",
        f"- Qwen3-VL-8B dimensions, random bf16 weights: {gb:.2f} GB; pinned host copy {result['host_bytes'] / 1e9:.2f}"
        f" GB; weights bit-equal after the round trips: {result['bit_equal_after_round_trips']}", "",
        "| move | seconds | GB/s |", "|---|---:|---:|",
        f"| pageable GPU -> CPU (`module.to('cpu')`) | {result['pageable_to_cpu_s']:.2f} | "
        f"{result['pageable_to_cpu_gb_s']:.1f} |",
        f"| pageable CPU -> GPU (`module.to('cuda')`) | {result['pageable_to_gpu_s']:.2f} | "
        f"{result['pageable_to_gpu_gb_s']:.1f} |",
        f"| pinned copy made (page-locked and packed once per loaded file; here from the GPU) | "
        f"{result['pin_from_gpu_s']:.2f} | |",
        f"| pinned load (host copy -> GPU), median of {len(result['pinned_loads_s'])} | "
        f"{result['pinned_load_s']:.3f} | {result['pinned_load_gb_s']:.1f} |",
        f"| pinned offload (drop the GPU copy), median | {result['pinned_offload_s']:.4f} | |",
        f"| encode one prompt on the GPU | {result['encode_s']:.3f} | |",
        f"| encode one prompt streamed by layer (uploads included) | {result['streamed_encode_s']:.3f} | "
        f"{gb / result['streamed_encode_s']:.1f} |", "",
        f"Streamed by layer: peak {result['streamed_peak_bytes'] / 2**30:.2f} GiB on the GPU (the plan counts "
        f"{result['streamed_plan_bytes'] / 2**30:.2f} GiB: outside part {result['streamed_outside_bytes'] / 2**30:.2f}"
        f" GiB + 2 layers of {result['streamed_layer_bytes'] / 2**20:.0f} MiB + activations); bit-equal to the whole "
        f"encode: {result['streamed_bit_equal']}", "",
        "| placement | cost per changed prompt, s |", "|---|---:|",
        *[f"| {name} | {seconds:.2f} |" for name, seconds in per_prompt.items()], "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench placement: needs a CUDA GPU", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.timezone.utc)
    command = "python -m bench.placement " + " ".join(argv if argv is not None else sys.argv[1:])
    result = measure(repeats=args.repeats)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%S")
    md = out / f"placement-{stamp}.md"
    md.write_text(markdown(result, command.strip(), now.isoformat(timespec="seconds")))
    (out / f"placement-{stamp}.json").write_text(json.dumps(result, indent=2))
    print(md.read_text())
    return 0 if result["bit_equal_after_round_trips"] and result["streamed_bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
