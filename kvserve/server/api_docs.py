"""`/docs` and `/openapi.json`: the API described with its request bodies, browsable offline.

Request bodies are read by kvserve/server/parsing.py, not by FastAPI (so each malformed body gets
its own OpenAI error instead of a generic 422), which leaves FastAPI's OpenAPI document without
them. Each route in the table (kvserve/server/routes.py) names its body's pydantic model, and the
document gets the model's JSON schema as the operation's request body; the schemas are the ones parsing
uses, so the document cannot drift from what the server accepts. tests/test_fuzz.py fuzzes them.

Swagger UI's page loads its script and stylesheet from the server itself, never a CDN: the files
come from the `fastapi-offline` package (Swagger UI 5, which renders the OpenAPI 3.1 that FastAPI
writes; `swagger-ui-bundle` on PyPI ships Swagger UI 4, which cannot), served under /docs/.
The docs, their files and the document are open routes (no API key): they hold nothing secret,
and a browser cannot send the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext

ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}


def _assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict:
    """The OpenAPI document of `app`'s routes, with each POST body in `bodies` (path → model) described
    by its model's schema (made once)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, top = models_json_schema([(m, "validation") for m in bodies.values()],
                                    ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
        for path, model in bodies.items():
            doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
    return app.openapi_schema


async def docs(request: Request, ctx: ServerContext) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="kvserve — API",
                               swagger_js_url=f"{root}/docs/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}/docs/swagger-ui.css",
                               swagger_favicon_url=f"{root}/docs/favicon.png",
                               swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from swagger.io


async def asset(request: Request, ctx: ServerContext) -> FileResponse:
    name = request.path_params["name"]
    if name not in ASSETS:
        raise APIError(404, f"no file {name!r} here: /docs serves {', '.join(ASSETS)}", code="not_found")
    return FileResponse(_assets_dir() / name, media_type=ASSETS[name], headers={"Cache-Control": "max-age=86400"})


async def document(request: Request, ctx: ServerContext) -> JSONResponse:
    """/openapi.json (the app hands its document over as `request.app.openapi()`)."""
    return JSONResponse(request.app.openapi())
