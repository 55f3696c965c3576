"""Markdown and JSON reports of a benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("path", "path", "{}"), ("prefill_ms", "prefill ms", "{:.1f}"), ("decode_ms", "decode ms/step", "{:.2f}"),
    ("speedup_vs_diffusers", "x diffusers", "{:.2f}"), ("x_roofline", "/ roofline", "{:.2f}"),
    ("dit_40_steps_ms", "DiT 40 steps s", "{:.2f}", 1e-3), ("dit_8_steps_ms", "DiT 8 steps s", "{:.3f}", 1e-3),
    ("host_ms", "host ms/step", "{:.2f}"), ("capture_s", "capture s", "{:.2f}"), ("warmup_s", "warm-up+compile s", "{:.1f}"),
    ("peak_gb", "peak GiB", "{:.1f}"), ("weights_gb", "weights GiB", "{:.1f}"),
    ("block_weights_gb", "block weights GB", "{:.2f}"),
    ("graph_bytes", "graph GiB", "{:.2f}", 2**-30),
    ("psnr_vs_fp32_db", "PSNR vs fp32 dB", "{:.1f}"), ("err_ratio_vs_diffusers", "err / diffusers err", "{:.3f}"),
    ("quality_ok", "guard", "{}"), ("vs_own_eager_maxabs", "vs eager path", "{:.2e}"),
    ("replay_vs_body_maxabs", "replay vs own body", "{:.1e}"), ("sm_clock_mhz", "SM MHz", "{:.0f}"),
    ("power_w", "power W", "{:.0f}"), ("clock_limit", "clock held by", "{}"),
    ("decode_ms_after_idle", "ms/step after 3 s idle", "{:.2f}"),
]


def _cell(row, column):
    key, _, fmt, *scale = column
    value = row.get(key)
    if value is None:
        return ""
    if scale and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = value * scale[0]
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown(meta, results, amortization) -> str:
    lines = [f"# Decode benchmark, {meta['date']}", "",
             f"- GPU: {meta['gpu']}; torch {meta['torch']}; diffusers {meta['diffusers']}; "
             f"{meta['layers']} blocks, {meta['params_billion']:.2f} B parameters, random bf16 weights",
             f"- command: `{meta['command']}` ({meta['wall_s']} s)",
             f"- roofline: FLOPs / {meta['peak_tflops_assumed']} TFLOP/s; quality guard: {meta['quality_guard']}",
             f"- fastest path passing the guard: **{meta['fastest_passing_path']}**",
             "- prefill: diffusers' extract forward (which also predicts step 1); ours the prefix rows alone (step 1 "
             "is then a decode step), eager on the eager path, a replay of the entry's captured prefix pass on "
             "graph paths",
             "- decode ms/step: median of CUDA-event timings of steps run one after another, where a step at 512x512 "
             "or more draws the card's power limit (SM MHz, power W and the driver's reason for holding the clock, "
             "sampled while timing); ms/step after 3 s idle: one step at the clock the card boosts to", ""]
    for res in results:
        lines += [f"## {res['scenario']}: {res['pixels']}, {res['references']} reference(s), batch {res['batch']}, "
                  f"CFG {'on' if res['cfg'] else 'off'}; prefix tokens {res['prefix_tokens']}, "
                  f"target tokens {res['target_tokens']}, {res['rows'][-1]['decode_flop'] / 1e12:.1f} TFLOP/step, "
                  f"roofline {res['rows'][-1]['roofline_ms']:.1f} ms", ""]
        lines.append("| " + " | ".join(c[1] for c in COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        for row in res["rows"]:
            if "skipped" in row:
                lines.append(f"| {row['path']} | skipped: {row['skipped']} (ratios are against our eager step) |")
                continue
            lines.append("| " + " | ".join(_cell(row, c) for c in COLUMNS) + " |")
        lines.append("")
    lines += ["## Sampler runs (process-wide engine): back to back like queued prompts, and after the card idled "
              "like a lone prompt", "",
              "| run | steps | DiT total s | prefill ms | decode ms/step | captures | replays | compiles | "
              "eager steps | peak GiB | graph GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in amortization:
        lines.append(f"| {r['run']} | {r['steps']} | {r['dit_total_ms'] / 1e3:.3f} | {r['prefill_ms']:.1f} | "
                     f"{r['decode_ms_per_step']:.2f} | {r['captures']} | {r['replays']} | {r['compiles']} | "
                     f"{r['eager_steps'] or 0} | {_fmt(r['peak_gb'], '{:.1f}')} | {r['graph_bytes'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def _fmt(value, fmt):
    return "" if value is None else fmt.format(value)


def write_reports(out_dir: Path, meta, results, amortization, profile_text=None, fp8_report=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    md_path = out_dir / f"decode-{stamp}.md"
    json_path = out_dir / f"decode-{stamp}.json"
    text = markdown(meta, results, amortization)
    if fp8_report:
        from .fp8_quality import markdown as fp8_markdown

        text += "\n" + (fp8_markdown(fp8_report) if "error" not in fp8_report
                        else f"## FP8 quality bound\n\nFAILED: {fp8_report['error']}\n")
    if profile_text:
        text += "\n## Profile\n\n```\n" + profile_text + "\n```\n"
    md_path.write_text(text)
    payload = {"meta": meta, "scenarios": results, "amortization": amortization}
    if fp8_report:
        payload["fp8_quality"] = fp8_report
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    return md_path, json_path
