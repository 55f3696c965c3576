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


def show_text(text: str) -> None:
    """Show `text` on the running node in the frontend, the way core's Get Image Size does: ComfyUI's progress-text
    message, which the frontend draws as a read-only text box on that node. Sent to the client that queued the
    prompt (as ComfyUI sends `executed`); a server without the message, or no client, shows nothing."""
    _, node_id = executing_ids()
    try:
        from server import PromptServer

        server = PromptServer.instance
        client = getattr(server, "client_id", None)
        if node_id is None or client is None:
            return
        server.send_progress_text(text, node_id, client)
    except Exception as exc:  # noqa: BLE001 - showing the text must not fail the node
        logger.debug("KV-Graph: could not show the node's text: %s", exc)
