"""`/docs` and `/openapi.json`: the API described with its request bodies, browsable offline.

Request bodies are read by kvserve/server/parsing.py, not by FastAPI (so each malformed body gets
its own OpenAI error instead of a generic 422), which leaves FastAPI's OpenAPI document without
them. Each generation route names its pydantic model here (`document_body`), and the document
gets the model's JSON schema as the operation's request body; the schemas are the ones parsing
uses, so the document cannot drift from what the server accepts. tests/test_fuzz.py fuzzes them.

Swagger UI's page loads its script and stylesheet from the server itself, never a CDN: the files
come from the `fastapi-offline` package (Swagger UI 5, which renders the OpenAPI 3.1 that FastAPI
writes; `swagger-ui-bundle` on PyPI ships Swagger UI 4, which cannot), served under /docs/.
The docs, their files and the document are open routes (no API key): they hold nothing secret,
and a browser cannot send the key.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve.server.errors import APIError

ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}
OPEN_PATHS = frozenset({"/docs", "/openapi.json", *(f"/docs/{name}" for name in ASSETS)})


def _assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def document_body(app: FastAPI, path: str, model: type[BaseModel]) -> None:
    """Describe POST `path`'s JSON body in /openapi.json as `model`'s schema."""
    app.state.request_bodies[path] = model
    app.openapi_schema = None  # made again on the next request


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bodies: dict[str, type[BaseModel]] = app.state.request_bodies
        _, top = models_json_schema([(m, "validation") for m in bodies.values()],
                                    ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
        for path, model in bodies.items():
            doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
    return app.openapi_schema


def add_routes(app: FastAPI) -> None:
    """/docs and its files; /openapi.json with the documented bodies (FastAPI serves it)."""
    app.state.request_bodies = {}
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    assets = _assets_dir()

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title=f"{app.title} — API",
                                   swagger_js_url=f"{root}/docs/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}/docs/swagger-ui.css",
                                   swagger_favicon_url=f"{root}/docs/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from swagger.io

    @app.get("/docs/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise APIError(404, f"no file {name!r} here: /docs serves {', '.join(ASSETS)}", code="not_found")
        return FileResponse(assets / name, media_type=ASSETS[name], headers={"Cache-Control": "max-age=86400"})
