"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code or str(status)}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
