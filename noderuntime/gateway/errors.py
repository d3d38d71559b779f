"""Errors answered in OpenAI's shape, and when a client should try again."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from noderuntime.runner.policy import RunError


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# how long a client should wait before trying a busy (429) or routeless (503) gateway
# again: the official clients honour it, and nodes report their sessions each second
RETRY_AFTER_SECONDS = 1


def error_response(error: ApiError) -> JSONResponse:
    headers = {"retry-after": str(RETRY_AFTER_SECONDS)} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# how each of the runner's errors is answered: HTTP status and OpenAI's error type
_RUN_ERRORS = {
    "routes_full": (429, "rate_limit_error"),
    "queue_full": (429, "rate_limit_error"),
    "client_closed": (499, "client_closed"),
    "no_route": (503, "service_unavailable"),
    "tracker": (503, "service_unavailable"),
    "route_failed": (503, "service_unavailable"),
    # a route reply that is not the tracker's: the gateway's upstream is not who it should be
    "untrusted_route": (502, "service_unavailable"),
    "deadline_exceeded": (504, "timeout"),
}


def run_error(error: RunError) -> ApiError:
    """The runner's ``error`` as the client is answered it."""
    status, kind = _RUN_ERRORS[error.code]
    return ApiError(status, str(error), kind, error.code)
