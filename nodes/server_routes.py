"""HTTP routes: GET /kvgraph/status and POST /kvgraph/release (also served under /api/ by ComfyUI).

Handlers run on ComfyUI's server thread; everything they read about the graph managers is read under each manager's
lock (`engine.status()`), and a release for an engine that is sampling right now waits for the run to finish.
"""

from __future__ import annotations

import json
import logging

from . import pack_files, status

logger = logging.getLogger("kvgraph")

STATUS_PATH = "/kvgraph/status"
RELEASE_PATH = "/kvgraph/release"
EXPECTED_BODY = 'send a JSON object such as {"models": true} (or no body)'
_registered = []


def parse_release_body(body: bytes | str | None) -> tuple[int, dict]:
    """Decode and validate a release request's body (JSON; empty means `{}`); returns (HTTP status, the parsed
    options or the error). Never raises: a body that is too deeply nested for the JSON parser is a 400 like any
    other bad body, not a server error."""
    parsed = {}
    if body is not None and body.strip():
        try:
            parsed = json.loads(body)
        except RecursionError:
            return 400, {"error": f"the body is nested too deeply; {EXPECTED_BODY}"}
        except ValueError:  # not JSON, or not UTF-8
            return 400, {"error": f"the body is not valid JSON; {EXPECTED_BODY}"}
    if parsed is None:
        parsed = {}
    if not isinstance(parsed, dict):
        return 400, {"error": f"the body is not a JSON object; {EXPECTED_BODY}"}
    models = parsed.get("models", False)
    if not isinstance(models, bool):
        return 400, {"error": f"'models' must be true or false, got {models!r:.80}"}
    return 200, {"models": models}


def release_response(body: bytes | str | None) -> tuple[int, dict]:
    code, parsed = parse_release_body(body)
    if code != 200:
        return code, parsed
    return 200, status.release(models=parsed["models"])


def register(pack_dir: str | None = None) -> None:
    """Add the routes to ComfyUI's server (and, for a pack folder whose name needs URL quoting, the routes serving
    its web files: see pack_files). Called at import inside ComfyUI; a second call does nothing."""
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
        # The raw bytes, parsed by parse_release_body: aiohttp's request.json() lets a RecursionError escape (a 500).
        body = await request.read() if request.can_read_body else None
        code, payload = release_response(body)
        return web.json_response(payload, status=code)

    _registered.append((kvgraph_status, kvgraph_release))
    if pack_dir is not None:
        pack_files.register(routes, pack_dir)
