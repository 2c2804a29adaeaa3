"""OpenAI-style errors: every refusal the gateway makes (validation, auth, admission, mesh errors) is an
`ApiError` carrying the HTTP status and body fields, the HTTP layer's one way to answer
`{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any

# OpenAI's `type` strings by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request the gateway refuses or could not finish; `status` is the HTTP status code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: the official clients read `error.message` and map the status themselves."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param=param, code="unsupported")


def mesh_error(code: int, message: str) -> ApiError:
    """A refusal or failure reported by the mesh (SubmitReply / RequestError), codes are HTTP-like."""
    status = code if code in _TYPES else 500
    return ApiError(status, message, code=_MESH_CODES.get(status))


_MESH_CODES = {
    400: "invalid_value",
    404: "not_found",
    429: "queue_full",
    500: "internal_error",
    503: "unavailable",
    504: "timeout",
}
