"""Errors as the OpenAI API returns them.

Every failure the server answers (bad request, unknown model, missing API
key, engine gone) is an :class:`OpenAIError` turned into the body
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
``param`` names the offending field. The package's own ``ValueError`` s say
``"field: what was expected, what was got"``; :func:`from_value_error`
reads the field from that prefix.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from fastapi.responses import Response

from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    @property
    def type(self) -> str:
        # OpenAI's types: the client's fault, or the server's.
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> ErrorResponse:
        info = ErrorInfo(
            message=self.message, type=self.type, param=self.param, code=self.code
        )
        return ErrorResponse(error=info)

    def response(self) -> Response:
        # ASCII JSON: a message may quote the request's text, and a lone
        # surrogate there (valid in JSON, not in UTF-8) stays escaped
        body = json.dumps(self.body().model_dump())
        return Response(body, status_code=self.status, media_type="application/json")


def from_value_error(
    error: ValueError, renames: dict[str, str] | None = None
) -> OpenAIError:
    """A 400 for a ``ValueError`` of the engine or ``SamplingParams``, its
    field renamed to the request's spelling (the engine's ``prompt`` is
    chat's ``messages``)."""
    message = str(error)
    param = None
    if match := _FIELD.match(message):
        param = match.group(1)
        if renames and param in renames:
            param = renames[param]
            message = f"{param}: {message[match.end() :]}"
    code = "context_length_exceeded" if "max_model_len" in message else None
    return OpenAIError(message, param=param, code=code)
