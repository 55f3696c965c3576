"""The FP8 path's quality bound, measured on the benchmark's random weights against an fp32 run.

Bound (the performance issue's): the FP8 path's error against fp32 must not exceed the error of ComfyUI's default
INT8 ConvRot W8A8 path (`int8_reference.py`) on the same weights, per block and through the whole step. Errors:

- **per block**: each block run alone on the fp32 run's input to it (cast to bf16; the fp32 prefix K/V cast too), its
  update to the residual stream (`out - in`, with the handed-over MLP residual added) against the fp32 block's
  update: `||d - d32|| / ||d32||`. Every variant sees the same inputs, so this isolates each block's own math.
- **whole step**: the variant's own prefix pass and decode step from the scenario's bf16 inputs, its output against
  the fp32 run's: `||o - o32|| / ||o32||` (the decode benchmark's metric).

Variants: `bf16` (our step as loaded), `int8-convrot` (the bound), the FP8 presets, each group alone in FP8
(`fp8:qkv`, ...: which groups FP8 hurts most), and `fp8+rotation`: every group in FP8 after the same group-wise
Hadamard rotation ConvRot applies (weights rotated once, activations on the fly), emulated here in PyTorch to see
whether rotating helps FP8 too (a product version would fuse the rotation into our kernels). A variant passes when
every block and the whole step stay within the INT8 errors. Random weights amplify rounding through 32 blocks, so
absolute figures mean little; the comparison on the same weights is the point.
"""

from __future__ import annotations

import contextlib
import gc
import math

import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.decode.kv_format import FP8, Fp8KVStore
from graph_runtime.decode.warm_up import prefilled_static_inputs
from graph_runtime.fp8.precisions import GROUPS, groups_of

from .int8_reference import KitchenInt8Linear, convrot_group
from .model import fp32_copy
from .swap import (ATTENTION_8BIT, ATTENTION_FP8_KV, ATTENTION_VARIANTS, RUNTIME_ATTENTION,  # noqa: F401
                   attention_swapped, quantized_linears, swapped)

INT8 = "int8-convrot"
ROTATED = "fp8+rotation"
FP8_PRESETS = ["fp8", "fp8-attn", "fp8-no-out"]
DEFAULT_VARIANTS = ["bf16", INT8, "int8", *FP8_PRESETS, *(f"fp8:{g}" for g in GROUPS), ROTATED]


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size `n` (a power of two), fp32."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


class RotatedFp8Linear(torch.nn.Module):
    """FP8 after a group-wise Hadamard rotation of the input features: `x W^T = (x H)(W H)^T` for orthonormal
    block-diagonal `H`, so rotating both operands changes only what the quantization sees. Emulated (fp32 rotation,
    then the FP8 GEMM of `fp8/linear.py`)."""

    def __init__(self, linear: torch.nn.Linear):
        from graph_runtime.fp8.linear import Fp8Linear

        super().__init__()
        self.group = convrot_group(linear.in_features)
        self.register_buffer("h", hadamard(self.group, linear.weight.device))
        rotated = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device=linear.weight.device,
                                  dtype=linear.weight.dtype)
        with torch.no_grad():
            rotated.weight.copy_(self._rotate(linear.weight).to(linear.weight.dtype))
        self.fp8 = Fp8Linear.from_linear(rotated)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return (x.float().reshape(*shape[:-1], -1, self.group) @ self.h).reshape(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fp8(self._rotate(x).to(x.dtype))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    num = (a.float() - b.float()).pow(2).sum().item()
    den = b.float().pow(2).sum().item()
    return math.sqrt(num / max(den, 1e-30))


def _residual(x, pending) -> torch.Tensor:
    """The residual stream a block's `(x, pending)` stands for: `x + tanh(gate) * delta`, in fp32."""
    if pending is None:
        return x.float()
    delta, gate = pending
    return x.float() + torch.tanh(gate.float()) * delta.float()


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


@contextlib.contextmanager
def _recorded_blocks(step, store: list):
    """Record each block's call `(args, outputs)` (the residual and hand-off tensors cloned) while inside."""
    handles = []
    for block in step.blocks:
        def hook(module, args, output):
            x, pending = args[0], args[1]
            store.append({"x": x.clone(), "pending": None if pending is None else tuple(t.clone() for t in pending),
                          "rest": args[2:], "out": (output[0].clone(), tuple(t.clone() for t in output[1]))})

        handles.append(block.register_forward_hook(hook))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


class QualityRun:
    def __init__(self, transformer, device):
        self.transformer = transformer
        self.device = device
        self._modules: dict = {}

    def modules(self, variant: str) -> dict:
        """The Linears to swap in for `variant` (built once per group and shared between presets)."""
        if variant == "bf16":
            return {}
        from graph_runtime.fp8.convert import int8_factory

        # "int8" is our INT8 W8A8 (the same ConvRot weights as the bound, through our kernels); with 8-bit
        # attention, the same Linears.
        factories = {INT8: KitchenInt8Linear, ROTATED: RotatedFp8Linear, "int8": int8_factory()}
        if variant in ATTENTION_VARIANTS or variant in RUNTIME_ATTENTION:
            variant = "int8"
        if variant in factories:
            if variant not in self._modules:
                self._modules[variant] = quantized_linears(self.transformer, "fp8", factory=factories[variant])
            return self._modules[variant]
        modules = {}
        for group in groups_of(variant):
            if group not in self._modules:
                self._modules[group] = quantized_linears(self.transformer, f"fp8:{group}")
            modules.update(self._modules[group])
        return modules

    def release(self):
        self._modules.clear()


def _reference(model32, inputs32) -> dict:
    """The fp32 run: every branch's output, and the first branch's per-block records."""
    outputs, records = [], []
    engine32 = DecodeEngine(model32)
    step32 = engine32.step
    for n, branch in enumerate(inputs32.branches):
        static = prefilled_static_inputs(model32, branch.layout, inputs32.hidden_all, branch.embeds,
                                         inputs32.timestep, inputs32.latents)
        with _recorded_blocks(step32, records) if n == 0 else contextlib.nullcontext():
            outputs.append(step32(static))
        if n == 0:
            records[0]["static"] = static
    return {"outputs": outputs, "blocks": records}


def _block_errors(transformer, reference: dict, dtype, attention: str = "auto") -> list[float]:
    # Built now: the variant's Linears are the ones swapped in.
    step = DecodeEngine(transformer, attention=attention).step
    static32 = reference["blocks"][0]["static"]
    prefix_len = static32.prefix_len
    device = static32.hidden.device
    # Blocks called one by one get the attention kernel the step would run them with.
    step.use_attention(step.blocks, device, dtype)
    fp8 = _fp8_prefix(transformer, static32, dtype) if step.kv_format(device, dtype) == FP8 else None
    errors = []
    for i, (block, record) in enumerate(zip(step.blocks, reference["blocks"])):
        x, pending = _cast(record["x"], dtype), _cast(record["pending"], dtype)
        modulation, cos, sin, _, _, _, static_kv, mask = record["rest"]
        # The prefix rows as fp32 had them (in e4m3, as a graph entry loads them, for FP8 attention).
        caches = (fp8.block(i), None) if fp8 else [t.to(dtype) for t in (static32.k[i], static32.v[i])]
        out_x, out_pending = block(x, pending, modulation.to(dtype), cos, sin, *caches, prefix_len, static_kv, mask)
        update = _residual(out_x, out_pending) - _residual(x, pending)
        update32 = _residual(*record["out"]) - _residual(record["x"], record["pending"])
        errors.append(_rel(update, update32))
        del caches, out_x, out_pending, update
    return errors


def _fp8_prefix(transformer, static32, dtype) -> Fp8KVStore:
    """The fp32 run's prefix rows loaded into e4m3 K/V buffers by the runtime's own rule (kv_format.py)."""
    batch, total, heads, head_dim = static32.k[0].shape
    prefix_len = static32.prefix_len
    norms = [(b.attn.norm_q.weight, b.attn.norm_k.weight) for b in transformer.transformer_blocks]
    store = Fp8KVStore(batch, prefix_len, total - prefix_len, heads, head_dim, len(norms), dtype,
                       static32.hidden.device, norms)
    store.load_prefix([k[:, :prefix_len].to(dtype) for k in static32.k],
                      [v[:, :prefix_len].to(dtype) for v in static32.v])
    return store


def _step_outputs(transformer, inputs, attention: str = "auto") -> list[torch.Tensor]:
    engine = DecodeEngine(transformer, attention=attention)  # built now: the variant's Linears are swapped in
    outs = []
    for branch in inputs.branches:
        static = prefilled_static_inputs(transformer, branch.layout, inputs.hidden_all, branch.embeds,
                                         inputs.timestep, inputs.latents, engine.step.kv_format())
        outs.append(engine.step(static))
    return outs


def measure(transformer, scenario_inputs: dict, device, variants=DEFAULT_VARIANTS) -> dict:
    """`scenario_inputs`: {name: ScenarioInputs in the model's dtype}. Returns errors per scenario and variant, and
    each variant's verdict against the INT8 bound."""
    dtype = next(transformer.parameters()).dtype
    run = QualityRun(transformer, device)
    results: dict = {}
    model32 = fp32_copy(transformer)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for name, inputs in scenario_inputs.items():
                reference = _reference(model32, inputs.to(torch.float32))
                per_variant = {}
                for variant in variants:
                    attention = ATTENTION_VARIANTS.get(variant, "sdpa")
                    runtime = RUNTIME_ATTENTION.get(variant, "auto")
                    with swapped(transformer, run.modules(variant)), attention_swapped(attention):
                        blocks = _block_errors(transformer, reference, dtype, runtime)
                        step = _step_errors(transformer, inputs, reference["outputs"], runtime)
                    per_variant[variant] = {"block_err": blocks, "step_err": step}
                    if runtime != "auto":  # what the engine's attention ran as here (a fallback is not FP8)
                        engine = DecodeEngine(transformer, attention=runtime)
                        per_variant[variant]["kv_format"] = engine.step.kv_format(device, dtype)
                    # One variant's quantized Linears at a time: all of them beside the fp32 copy outgrow an
                    # 80 GB card (a group shared by two presets is quantized again, which costs seconds).
                    run.release()
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                results[name] = per_variant
                del reference
                gc.collect()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del model32
        run.release()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report = {"variants": list(variants), "scenarios": results, "verdicts": verdicts(results)}
    if KitchenInt8Linear.fallback:
        report["int8_note"] = f"comfy-kitchen's portable int8_linear ran: {KitchenInt8Linear.fallback}"
    return report


def _step_errors(transformer, inputs, outputs32, attention: str = "auto") -> float:
    outs = _step_outputs(transformer, inputs, attention)
    num = sum((o.float() - r.float()).pow(2).sum().item() for o, r in zip(outs, outputs32))
    den = sum(r.float().pow(2).sum().item() for r in outputs32)
    return math.sqrt(num / max(den, 1e-30))


def verdicts(results: dict) -> dict:
    """Per variant and scenario: blocks within the INT8 error, the worst block ratio, the step ratio, pass/fail."""
    out: dict = {}
    for scenario, per_variant in results.items():
        bound = per_variant.get(INT8)
        if bound is None:
            continue
        for variant, errs in per_variant.items():
            if variant == INT8:
                continue
            ratios = [e / max(b, 1e-30) for e, b in zip(errs["block_err"], bound["block_err"])]
            step_ratio = errs["step_err"] / max(bound["step_err"], 1e-30)
            passing = sum(r <= 1.0 for r in ratios)
            verdict = out.setdefault(variant, {})[scenario] = {
                "blocks_within": passing, "blocks": len(ratios), "worst_block_ratio": max(ratios),
                "step_ratio": step_ratio, "pass": passing == len(ratios) and step_ratio <= 1.0}
            if errs.get("kv_format", FP8) != FP8:
                # The runtime fell back to bf16 attention here: its errors are not FP8 attention's.
                verdict.update({"pass": False, "note": "FP8 attention did not run (it fell back to bf16)"})
    return out


def passes(report: dict, variant: str) -> bool | None:
    """Whether `variant` met the bound in every measured scenario (None if it was not measured)."""
    scenarios = report.get("verdicts", {}).get(variant)
    return None if not scenarios else all(v["pass"] for v in scenarios.values())


def summary_lines(report: dict) -> list[str]:
    lines = []
    for variant, scenarios in report.get("verdicts", {}).items():
        for scenario, v in scenarios.items():
            errs = report["scenarios"][scenario]
            lines.append(f"{variant} on {scenario}: {'PASS' if v['pass'] else 'FAIL'} - blocks within the INT8 "
                         f"ConvRot error {v['blocks_within']}/{v['blocks']} (worst ratio {v['worst_block_ratio']:.2f}),"
                         f" whole step {errs[variant]['step_err']:.3e} vs INT8 {errs[INT8]['step_err']:.3e} "
                         f"(ratio {v['step_ratio']:.2f})" + (f" - {v['note']}" if v.get("note") else ""))
    return lines


def markdown(report: dict) -> str:
    lines = ["## FP8 quality bound: error vs fp32 against ComfyUI's INT8 ConvRot W8A8 on the same weights", "",
             "Per block: each block alone on the fp32 run's input, its residual update's relative L2 error; whole "
             "step: the variant's own prefix pass and step, its output's relative L2 error. A variant passes when "
             "every block and the step stay within the INT8 ConvRot errors."
             + (f" Note: {report['int8_note']}." if report.get("int8_note") else ""), "",
             "| scenario | variant | whole step err | / INT8 | blocks within INT8 | worst block / INT8 | "
             "mean block err | bound |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for scenario, per_variant in report.get("scenarios", {}).items():
        for variant, errs in per_variant.items():
            v = report["verdicts"].get(variant, {}).get(scenario)
            mean_block = sum(errs["block_err"]) / max(len(errs["block_err"]), 1)
            if v is None:
                lines.append(f"| {scenario} | {variant} | {errs['step_err']:.3e} | | | | {mean_block:.3e} | "
                             f"(the bound) |")
                continue
            lines.append(f"| {scenario} | {variant} | {errs['step_err']:.3e} | {v['step_ratio']:.2f} | "
                         f"{v['blocks_within']}/{v['blocks']} | {v['worst_block_ratio']:.2f} | {mean_block:.3e} | "
                         f"{'pass' if v['pass'] else 'FAIL'}{' (' + v['note'] + ')' if v.get('note') else ''} |")
    return "\n".join(lines) + "\n"
