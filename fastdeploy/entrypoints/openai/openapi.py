"""The OpenAPI document of the server, with the request body of every JSON route.

The routes parse their bodies themselves (strict validation, OpenAI-style
errors), so FastAPI cannot infer the bodies; :func:`json_body` declares one,
and the document served at ``/openapi.json`` carries the full request schemas,
for ``/docs``, client generators and schema-driven fuzzers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.params import Depends
from pydantic import TypeAdapter
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from fastdeploy.entrypoints.openai.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
ERROR_STATUSES = {
    "400": "Invalid request (the error names the field)",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "415": "Body not sent as application/json",
    "503": "Engine unavailable or server stopping",
}

_REQUEST_MODELS: dict[str, Any] = {}
"""Schema name → the type of a request body, filled by :func:`json_body`."""


def json_body(model: Any, name: str | None = None) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model`` (a pydantic model or a union of them)."""
    name = name or model.__name__
    _REQUEST_MODELS[name] = model
    ref = {"$ref": REF_TEMPLATE.format(model=name)}
    error = {
        "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}
    }
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "responses": {code: {"description": text, **error} for code, text in ERROR_STATUSES.items()},
    }


def _component_schemas() -> dict[str, Any]:
    """JSON schemas of every declared request body and of the error body, by name."""
    schemas: dict[str, Any] = {}
    for name, model in [*_REQUEST_MODELS.items(), ("ErrorResponse", ErrorResponse)]:
        schema = TypeAdapter(model).json_schema(ref_template=REF_TEMPLATE)
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    return schemas


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with the request schemas (built once, then cached on the app)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        document.setdefault("components", {}).setdefault("schemas", {}).update(_component_schemas())
        app.openapi_schema = document
    return app.openapi_schema


def add_openapi_routes(app: FastAPI, dependencies: Sequence[Depends]) -> None:
    """Serve ``/openapi.json`` and ``/docs`` (Swagger UI) behind ``dependencies`` (the API key check)."""
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=list(dependencies))
    async def openapi_json() -> Response:
        return JSONResponse(openapi_document(app))

    @app.get("/docs", include_in_schema=False, dependencies=list(dependencies))
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API")
