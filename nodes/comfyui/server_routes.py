"""HTTP routes: GET /kvgraph/status and POST /kvgraph/release (also served under /api/ by ComfyUI). The release,
which changes state, answers only the ComfyUI page itself and clients that send no Origin (`origin_refusal`).

Handlers run on ComfyUI's server thread; everything they read about the graph managers is read under each manager's
lock (`engine.status()`), and a release for an engine that is sampling right now waits for the run to finish.

Also the routes serving the pack's web files and example workflows when its folder name needs URL quoting (a space,
say). ComfyUI serves a pack's WEB_DIRECTORY at /extensions/<folder>/ and its example_workflows/ at
/api/workflow_templates/<folder>/ through aiohttp static routes. aiohttp stores a static route's prefix URL-quoted
("kv graph" becomes "kv%20graph") but matches it against the request's decoded path ("kv graph"), so under such a
folder name every web file and template answers 404 while the nodes load fine (ComfyUI 0.8.0, aiohttp 3.14). The
frontend asks for exactly those URLs (ComfyUI's /extensions list quotes the name; the browser quotes the template
URL), so the pack adds routes for the same paths, matched on the decoded name, serving the same files. Where the
static route does match, it is found first and these are never reached.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse

from ...graph_runtime.errors import printable, shorten
from ...graph_runtime.loading.paths import OutsideModelFolder, find_in_folders
from . import model_cache

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
    return 200, model_cache.release(models=parsed["models"])


# -- who may change state --------------------------------------------------------------------------------------------

CROSS_ORIGIN = ("refused: this request comes from another web page (its Origin header is {origin}), and KV-Graph's "
                "state-changing routes answer only the ComfyUI page itself or clients that send no Origin (curl, "
                "scripts); to allow a page on another origin, start ComfyUI with --enable-cors-header <that origin>")


def _host_port(netloc: str) -> tuple[str, int | None] | None:
    """(host name, port or None when not written) of a Host header or an origin's netloc; None when unreadable."""
    try:
        parts = urllib.parse.urlsplit(f"//{netloc}")
        return (parts.hostname or "").lower(), parts.port
    except ValueError:  # a port that is not a number
        return None


def _same_host(origin: tuple, host: tuple | None) -> bool:
    # Ports are compared only where both are written, as ComfyUI's own check does: a proxy that terminates TLS
    # forwards "https://name" to a Host of "name".
    return host is not None and origin[0] == host[0] and (origin[1] is None or host[1] is None or origin[1] == host[1])


def origin_refusal(headers, cors_origin: str | None = None) -> str | None:
    """Why a state-changing request must be refused, or None when it may go on. A request without an Origin header
    (curl, API clients) and one from the page the server itself serves go on; so does one from the origin ComfyUI was
    told to allow (`--enable-cors-header`, `cors_origin`; `*` allows every real origin). Refused: `Origin: null`
    (sandboxed frames, some redirects and file:// pages send it; ComfyUI's own origin check lets it through) and any
    other origin: a web page the user happens to visit must not be able to release the user's models."""
    origin = headers.get("Origin")
    if origin is None:
        return None
    shown = printable(shorten(repr(origin), 120))
    parsed = urllib.parse.urlsplit(origin.strip()) if origin.strip().lower() != "null" else None
    if parsed is None or not parsed.scheme or not parsed.netloc:
        return CROSS_ORIGIN.format(origin=shown)
    if cors_origin and (cors_origin == "*" or cors_origin.rstrip("/") == origin.strip().rstrip("/")):
        return None
    source = _host_port(parsed.netloc)
    hosts = [h.strip() for name in ("Host", "X-Forwarded-Host") for h in headers.get(name, "").split(",") if h.strip()]
    if source is not None and any(_same_host(source, _host_port(host)) for host in hosts):
        return None
    return CROSS_ORIGIN.format(origin=shown)


def _cors_origin() -> str | None:
    try:
        from comfy.cli_args import args
    except ImportError:
        return None
    return getattr(args, "enable_cors_header", None) or None


def register(pack_dir: str | None = None) -> None:
    """Add the routes to ComfyUI's server (and, for a pack folder whose name needs URL quoting, the routes serving
    its web files: `register_pack_files`). Called at import inside ComfyUI; a second call does nothing."""
    if _registered:
        return
    from aiohttp import web
    from server import PromptServer

    routes = PromptServer.instance.routes

    @routes.get(STATUS_PATH)
    async def kvgraph_status(request):
        return web.json_response(model_cache.status_payload())

    @routes.post(RELEASE_PATH)
    async def kvgraph_release(request):
        refusal = origin_refusal(request.headers, _cors_origin())
        if refusal is not None:
            logger.warning("KV-Graph: POST %s %s", RELEASE_PATH, refusal)
            return web.json_response({"error": refusal}, status=403)
        # The raw bytes, parsed by parse_release_body: aiohttp's request.json() lets a RecursionError escape (a 500).
        body = await request.read() if request.can_read_body else None
        code, payload = release_response(body)
        return web.json_response(payload, status=code)

    _registered.append((kvgraph_status, kvgraph_release))
    if pack_dir is not None:
        register_pack_files(routes, pack_dir)


# -- the pack's own files under a folder name that needs quoting -------------------------------------------------------

WEB_DIRECTORY = "web"
EXAMPLES_DIRECTORY = "example_workflows"
# ComfyUI serves every plain route under /api/ as well: the frontend fetches templates from /api/workflow_templates.
ROUTES = (("/extensions", WEB_DIRECTORY), ("/workflow_templates", EXAMPLES_DIRECTORY))


def needs_own_routes(folder_name: str) -> bool:
    return urllib.parse.quote(folder_name, safe="") != folder_name


def route_path(prefix: str, folder_name: str) -> str:
    """An aiohttp route path matching `prefix/<folder_name>/<file path>` on the decoded request path. The name goes
    in as a regex of escaped code points, so no character of it can act as pattern syntax (aiohttp leaves `%25`
    undecoded, so a `%` is matched in that form)."""
    regex = "".join("%25" if c == "%" else c if c.isascii() and c.isalnum() else f"\\U{ord(c):08x}"
                    for c in folder_name)
    return f"{prefix}/{{pack:{regex}}}/{{path:.+}}"


def file_handler(root: str):
    """A GET handler serving the files under `root`, with the model-path containment rules (no `..`, no absolute
    path): anything else is a 404."""
    from aiohttp import web

    async def handler(request):
        try:
            path = find_in_folders([root], request.match_info["path"], input_name="path", folder=root)
        except OutsideModelFolder:
            path = None
        if path is None:
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    return handler


def register_pack_files(routes, pack_dir: str) -> list[str]:
    """Add the routes when the pack's folder name needs quoting; returns the route paths added."""
    folder_name = os.path.basename(os.path.normpath(pack_dir))
    if not needs_own_routes(folder_name):
        return []
    added = []
    for prefix, directory in ROUTES:
        root = os.path.join(pack_dir, directory)
        if os.path.isdir(root):
            path = route_path(prefix, folder_name)
            routes.get(path)(file_handler(root))
            added.append(path)
    logger.info("KV-Graph: the pack's folder name %r needs URL quoting, which ComfyUI's static routes do not match; "
                "the pack serves its web files and example workflows itself (renaming the folder without spaces or "
                "non-ASCII letters also works).", folder_name)
    return added
