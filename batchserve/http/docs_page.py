"""`GET /docs`: Swagger UI over `/openapi.json`, every asset served by batchserve itself.

The UI's files come from the `swagger-ui-py` package, never from a CDN: the page must work on a host with no way
out, and should not tell a third party who reads it. A Content-Security-Policy of `'self'` refuses anything else
(the initializer is a file, not an inline script); the validator badge, which calls out, is off.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from batchserve import errors
from batchserve.http.shapes import docs_operations

# The files the page loads, and nothing else of the package's directory (its editor bundle is not served).
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'"
)

PAGE = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>batchserve API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/assets/favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"""

INIT = b"""window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout"
});
"""


HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}
CACHED = {**HEADERS, "Cache-Control": "public, max-age=86400"}


async def page(request: Request) -> Response:
    return Response(PAGE, media_type="text/html; charset=utf-8", headers=HEADERS)


async def init(request: Request) -> Response:
    return Response(INIT, media_type="text/javascript", headers=CACHED)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    media = ASSETS.get(name)
    if media is None:
        raise HTTPException(404, f"no asset {errors.short(name)!r} under /docs/assets")  # app's 404 shape
    assets = Path(str(importlib.resources.files("swagger_ui") / "static"))
    return FileResponse(assets / name, media_type=media, headers=CACHED)


ROUTES = [
    Route("/docs", page, methods=["GET"]),
    Route("/docs/init.js", init, methods=["GET"]),
    Route("/docs/assets/{name}", asset, methods=["GET"]),
]

OPERATIONS = docs_operations(sorted(ASSETS), sorted(set(ASSETS.values())))
