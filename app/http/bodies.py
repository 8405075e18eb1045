"""Request bodies read by hand: raw JSON into the route's pydantic model, refused in the
OpenAI error shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from app.http.errors import ApiError

ModelT = TypeVar("ModelT", bound=BaseModel)


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 `invalid_json` when it is not JSON or not an object."""
    body = _json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    return body


def parse_body(
    raw: bytes | dict[str, Any],
    model: type[ModelT],
    *,
    status: int = 422,
    code: str = "invalid_body",
    message: str = "{where}: {error}",
    skip_union_members: bool = False,
) -> ModelT:
    """The body (JSON, or a `json_object` already read) as `model`.

    400 `invalid_json` when it is not JSON; `status` with `code` when it does not validate,
    its first error's field as `param` and in `message` (`{where}`, `body` when it names
    none, and `{error}`). With `skip_union_members`, the names of a union's members (such as
    `literal['none','auto']`) are left out of the field: they name nothing in the body.
    """
    body = _json(raw) if isinstance(raw, bytes) else raw
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error["loc"], skip_union_members=skip_union_members)
        raise ApiError(
            status,
            message.format(where=param or "body", error=error["msg"]),
            code=code,
            param=param,
        ) from None


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None


def _param(loc: Sequence[int | str], *, skip_union_members: bool) -> str | None:
    parts = [str(part) for part in loc]
    if skip_union_members:
        parts = [part for part in parts if "[" not in part]
    return ".".join(parts) or None
