"""Nodes to inspect and release what the pack keeps between prompts (decode graphs and loaded models)."""

from __future__ import annotations

from comfy_api.latest import io

from . import status
from .types import CACHE


class KVGraphCacheStatus(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphCacheStatus",
            display_name="KV-Graph Cache Status",
            category=CACHE,
            description=("Reports every model KV-Graph has loaded and its decode-graph cache: entries (shapes), "
                         "captures, replays, eager steps and why, and memory held. Runs on every queue."),
            inputs=[],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls):
        return float("nan")  # never equal to itself: the report is read fresh on every queue

    @classmethod
    def execute(cls) -> io.NodeOutput:
        report = status.status_report()
        return io.NodeOutput(report, ui={"text": [report]})


class KVGraphReleaseCaches(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphReleaseCaches",
            display_name="KV-Graph Release Caches",
            category=CACHE,
            description=("Frees the captured decode graphs and their static buffers (a sampler running right now "
                         "keeps its own until it finishes). Optionally also drops the loaded models."),
            inputs=[
                io.Boolean.Input("release_models", default=False,
                                 tooltip="Also drop the transformer, text encoder and VAE that KV-Graph keeps loaded "
                                         "between prompts (the next prompt loads them from disk again)."),
            ],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, release_models):
        return float("nan")  # releasing is an action: do it on every queue

    @classmethod
    def execute(cls, release_models) -> io.NodeOutput:
        report = status.release_report(bool(release_models))
        return io.NodeOutput(report, ui={"text": [report]})


CACHE_NODES = [KVGraphCacheStatus, KVGraphReleaseCaches]
