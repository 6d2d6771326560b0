"""OpenAI-shaped error bodies, and the handlers that turn every failure into one.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with a meaningful status;
nothing reaches the client as a bare stack trace or as FastAPI's 422 list.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pagoda.engine.frontend.input_processor import InputError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagoda.engine.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with the HTTP status and OpenAI body fields it should produce."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code), status_code=err.status, headers=err.headers
    )


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # pydantic adds the union branch name ("str", "list[int]"...) to the path; keep the field path only.
    kept = [p for p in parts if p.isidentifier() or p.isdigit()]
    if not kept:
        return None
    out = kept[0]
    for p in kept[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(
            f"Unrecognized request field {param!r}: Pagoda does not support it", param, "unknown_field"
        )
    if kind == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json")
    if kind == "missing":
        return bad_request(f"Missing required field {param!r}", param, "missing_field")
    msg = first.get("msg", "invalid value")
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return bad_request(f"Invalid value for {param!r}: {msg}" if param else msg, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InputError)
    async def _input_error(_: Request, exc: InputError) -> JSONResponse:
        return error_response(bad_request(str(exc), exc.param, exc.code))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            message = "Not found: no such route"
        return JSONResponse(
            error_body(exc.status_code, message, code=getattr(exc, "code", None)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body(500, f"Internal server error: {type(exc).__name__}"), status_code=500)


class ErrorResponseModel(BaseModel):
    """The body of every error response (for the OpenAPI schema)."""

    class Inner(BaseModel):
        message: str
        type: str
        param: str | None = None
        code: str | int | None = None

    error: Inner
