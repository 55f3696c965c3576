"""Websocket events: `kvgraph.status` messages for each sampling phase (prefill, capture, replay, fallback, done).

The web extension and API clients listen for them; each carries the prompt id and node id. They go only to the
client that queued the prompt (the `client_id` of its POST /prompt, which ComfyUI keeps as
`PromptServer.instance.client_id` while the prompt runs, in 0.8.0 and 0.33.0 alike), as ComfyUI sends `executing`
and `executed`: other users' browsers see neither the prompt ids nor the toasts. A prompt queued without a client id
gets none, as in core. An event that cannot be sent never fails the prompt.
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


def _server():
    try:
        from server import PromptServer

        return PromptServer.instance
    except (ImportError, AttributeError):
        return None


def prompt_client() -> str | None:
    """The websocket client id of the prompt running now (None outside a prompt, or for one queued without it)."""
    return getattr(_server(), "client_id", None)


def sender(prompt_id: str | None, node_id: str | None):
    """`send` for one node's run: `(phase, data)` -> an event to the client that queued it, read once, when the node
    starts (a run's events all go to its own client)."""
    client = prompt_client()
    return lambda phase, data: send(phase, data, prompt_id, node_id, client)


def send(phase: str, data: dict, prompt_id: str | None = None, node_id: str | None = None,
         client_id: str | None = None) -> None:
    """One `kvgraph.status` event to `client_id`; nothing without one (never to every connected browser)."""
    server = _server()
    if server is None or client_id is None:
        return
    message = {"phase": phase, "prompt_id": prompt_id, "node": node_id, **data}
    try:
        server.send_sync(EVENT, message, client_id)
    except Exception as exc:  # noqa: BLE001 - telemetry must not break sampling
        logger.debug("KV-Graph: could not send %s event: %s", phase, exc)
