"""HTTP routes: GET /kvgraph/status and POST /kvgraph/release (also served under /api/ by ComfyUI).

Handlers run on ComfyUI's server thread; everything they read about the graph managers is read under each manager's
lock (`engine.status()`), and a release for an engine that is sampling right now waits for the run to finish.
"""

from __future__ import annotations

import logging

from . import status

logger = logging.getLogger("kvgraph")

STATUS_PATH = "/kvgraph/status"
RELEASE_PATH = "/kvgraph/release"
_registered = []


def parse_release_body(body) -> tuple[int, dict]:
    """Validate a release request body; returns (HTTP status, response)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return 400, {"error": "the body must be a JSON object such as {\"models\": true}"}
    models = body.get("models", False)
    if not isinstance(models, bool):
        return 400, {"error": f"'models' must be true or false, got {models!r}"}
    return 200, {"models": models}


def release_response(body) -> tuple[int, dict]:
    code, parsed = parse_release_body(body)
    if code != 200:
        return code, parsed
    return 200, status.release(models=parsed["models"])


def register() -> None:
    """Add the routes to ComfyUI's server. Called at import inside ComfyUI; a second call does nothing."""
    if _registered:
        return
    from aiohttp import web
    from server import PromptServer

    routes = PromptServer.instance.routes

    @routes.get(STATUS_PATH)
    async def kvgraph_status(request):
        return web.json_response(status.status_payload())

    @routes.post(RELEASE_PATH)
    async def kvgraph_release(request):
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "the body is not valid JSON"}, status=400)
        code, payload = release_response(body)
        return web.json_response(payload, status=code)

    _registered.append((kvgraph_status, kvgraph_release))
