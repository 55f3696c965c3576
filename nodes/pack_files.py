"""Serve the pack's web files and example workflows when its folder name needs URL quoting (a space, say).

ComfyUI serves a pack's WEB_DIRECTORY at /extensions/<folder>/ and its example_workflows/ at
/api/workflow_templates/<folder>/ through aiohttp static routes. aiohttp stores a static route's prefix URL-quoted
("kv graph" becomes "kv%20graph") but matches it against the request's decoded path ("kv graph"), so under such a
folder name every web file and template answers 404 while the nodes load fine (ComfyUI 0.8.0, aiohttp 3.14). The
frontend asks for exactly those URLs (ComfyUI's /extensions list quotes the name; the browser quotes the template
URL), so the pack adds routes for the same paths, matched on the decoded name, serving the same files. Where the
static route does match, it is found first and these are never reached.
"""

from __future__ import annotations

import logging
import os
import urllib.parse

from ..graph_runtime.loading.paths import OutsideModelFolder, find_in_folders

logger = logging.getLogger("kvgraph")

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


def register(routes, pack_dir: str) -> list[str]:
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
