"""Nodes to inspect and release what the pack keeps between prompts (decode graphs and loaded models).

Both have an optional pass-through: ComfyUI runs a node once its inputs are ready, so a node without inputs runs
first. Wiring the sampler's latent through one (sampler -> Cache Status -> VAE Decode) makes it run after the
sampler, so the report shows that run. Each shows its report on the node (kept there until it runs again) and
returns it as a STRING.
"""

from __future__ import annotations

from comfy_api.latest import io

from .comfyui import model_cache
from .comfyui.types import CACHE

REPORT_TOOLTIP = "The same report as text, e.g. for a Preview as Text or Save Text node."


def passthrough_sockets(runs_after: str) -> tuple[io.Input, io.Output]:
    """An optional input of any type and an output of the same type that hands it on unchanged."""
    template = io.MatchType.Template("passthrough")
    return (io.MatchType.Input("passthrough", template=template, optional=True,
                               tooltip=f"Optional, any type. Connect e.g. the sampler's latent to {runs_after}; the "
                                       "value comes out unchanged at the passthrough output."),
            io.MatchType.Output(template=template, display_name="passthrough",
                                tooltip="The passthrough input, unchanged (nothing when it is not connected)."))


def report_output(report: str, passthrough) -> io.NodeOutput:
    # ui text: the `executed` message the pack's web extension shows on the node (web/report_text.js), and /history's
    # record for API clients.
    return io.NodeOutput(report, passthrough, ui={"text": [report]})


class KVGraphCacheStatus(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        passthrough_in, passthrough_out = passthrough_sockets("report after that node ran")
        return io.Schema(
            node_id="KVGraphCacheStatus",
            display_name="KV-Graph Cache Status",
            category=CACHE,
            description=("Reports every model KV-Graph has loaded and its decode-graph cache: entries (shapes), "
                         "captures, replays, eager steps and why, and memory held. Runs on every queue; wire the "
                         "sampler's latent through it to report after the sampler."),
            inputs=[passthrough_in],
            outputs=[io.String.Output(display_name="report", tooltip=REPORT_TOOLTIP), passthrough_out],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, passthrough=None):
        return float("nan")  # never equal to itself: the report is read fresh on every queue

    @classmethod
    def execute(cls, passthrough=None) -> io.NodeOutput:
        return report_output(model_cache.status_report(), passthrough)


class KVGraphReleaseCaches(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        passthrough_in, passthrough_out = passthrough_sockets("release after that node ran")
        return io.Schema(
            node_id="KVGraphReleaseCaches",
            display_name="KV-Graph Release Caches",
            category=CACHE,
            description=("Frees the captured decode graphs and their static buffers (a sampler running right now "
                         "keeps its own until it finishes). Optionally also drops the loaded models. Wire the "
                         "sampler's latent through it to release after the sampler."),
            inputs=[
                io.Boolean.Input("release_models", default=False,
                                 tooltip="Also drop the transformer, text encoder and VAE that KV-Graph keeps loaded "
                                         "between prompts (the next prompt loads them from disk again)."),
                passthrough_in,
            ],
            outputs=[io.String.Output(display_name="report", tooltip=REPORT_TOOLTIP), passthrough_out],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, release_models=False, passthrough=None):
        return float("nan")  # releasing is an action: do it on every queue

    @classmethod
    def execute(cls, release_models, passthrough=None) -> io.NodeOutput:
        return report_output(model_cache.release_report(bool(release_models)), passthrough)


CACHE_NODES = [KVGraphCacheStatus, KVGraphReleaseCaches]
