"""Websocket events: `kvgraph.status` messages for each sampling phase (prefill, capture, replay, fallback, done).

The web extension and API clients listen for them; each carries the prompt id and node id so a client can tell its
own runs apart. An event that cannot be sent never fails the prompt.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvgraph")

EVENT = "kvgraph.status"


def executing_ids() -> tuple[str | None, str | None]:
    """(prompt id, node id) of the node running on this thread, when ComfyUI says."""
    try:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
    except ImportError:
        context = None
    if context is None:
        return None, None
    return context.prompt_id, context.node_id


def send(phase: str, data: dict, prompt_id: str | None = None, node_id: str | None = None) -> None:
    try:
        from server import PromptServer

        server = PromptServer.instance
    except (ImportError, AttributeError):
        return
    message = {"phase": phase, "prompt_id": prompt_id, "node": node_id, **data}
    try:
        server.send_sync(EVENT, message)
    except Exception as exc:  # noqa: BLE001 - telemetry must not break sampling
        logger.debug("KV-Graph: could not send %s event: %s", phase, exc)
