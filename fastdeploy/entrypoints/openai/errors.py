"""Errors of the OpenAI-compatible server and their ``{"error": {...}}`` bodies.

Every failure the server reports is an :class:`OpenAIError`; the app turns it
into a JSON response with the status code and the body the official clients
parse (``message``, ``type``, ``param``, ``code``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class OpenAIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status_code: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        message = encodable(message)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else encodable(param)
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def is_valid_unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (it holds no lone UTF-16 surrogate such as ``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encodable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes, so that it always encodes as UTF-8.

    Error messages quote what the client sent, which may not be valid Unicode;
    the error body must still be sendable.
    """
    if is_valid_unicode(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class BadRequestError(OpenAIError):
    """400: the request is malformed or asks for something invalid."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(OpenAIError):
    """401: the API key is missing or wrong."""

    status_code = 401
    error_type = "authentication_error"


class NotFoundError(OpenAIError):
    """404: unknown model name or route."""

    status_code = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(OpenAIError):
    """413: the request body is over the server's size limit."""

    status_code = 413
    error_type = "invalid_request_error"


class UnsupportedMediaTypeError(OpenAIError):
    """415: the body is not sent as JSON."""

    status_code = 415
    error_type = "invalid_request_error"


class ServiceUnavailableError(OpenAIError):
    """503: the engine is dead or not healthy; new requests cannot be served."""

    status_code = 503
    error_type = "service_unavailable_error"


class ClientDisconnectedError(OpenAIError):
    """The client went away before the response was ready (nginx's 499); nothing is sent."""

    status_code = 499
    error_type = "client_closed_request"


class InternalServerError(OpenAIError):
    """500: an unexpected failure while serving a request."""

    status_code = 500
    error_type = "server_error"


def _format_loc(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content")`` → ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop the union-member tags pydantic puts into locations (``list[int]``, ``str``, ...)."""
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _TYPE_TAGS))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"}


def validation_error_to_openai(errors: list[dict[str, Any]]) -> BadRequestError:
    """Turn pydantic (or FastAPI) validation errors into one 400 with ``param`` set.

    The first error decides ``param`` and the message; unknown fields get the
    wording OpenAI uses (``Unrecognized request argument supplied: x``).
    """
    if not errors:
        return BadRequestError("Invalid request")
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header") and len(loc) > 1:
        loc = loc[1:]  # FastAPI prefixes the location
    loc = _clean_loc(loc)
    param = _format_loc(loc) or None
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    if kind == "json_invalid":
        return BadRequestError(
            f"Invalid JSON body: {msg.removeprefix('Invalid JSON: ')}", code="invalid_json"
        )
    if kind == "model_type" and not loc:
        return BadRequestError("The request body must be a JSON object")
    if kind == "extra_forbidden":
        return BadRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return BadRequestError(f"Missing required parameter: {param}", param=param)
    msg = msg.removeprefix("Value error, ")
    return BadRequestError(f"{param}: {msg}" if param else msg, param=param)


def from_pydantic(exc: ValidationError) -> BadRequestError:
    """A 400 for a pydantic ``ValidationError`` raised while parsing a request."""
    return validation_error_to_openai(exc.errors(include_url=False))
