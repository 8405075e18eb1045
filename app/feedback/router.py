"""`POST /v1/feedback`: what the IDE saw happen to the completions it was served."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from redis.exceptions import RedisError

from app.auth.schemas import Principal
from app.config import Settings
from app.feedback.schemas import FeedbackAccepted, FeedbackBatch
from app.feedback.service import accept_feedback
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.models import Role

router = APIRouter(prefix="/v1", tags=["feedback"])


@router.post("/feedback", status_code=202, response_model=FeedbackAccepted)
async def post_feedback(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> FeedbackAccepted:
    """Queue a batch of IDE events; any invalid event rejects the batch with 422.

    Events are idempotent by `event_id`: a resent batch is answered 202 again and counted
    as duplicates. An event on a request this key was not served is answered 404. Follow-up
    messages on a privacy-mode completion (or sent with `X-Rtrl-Privacy: 1`, or by a
    privacy-mode key) are classified here and their text is dropped.
    """
    settings: Settings = request.app.state.settings
    batch = _batch(await request.body())
    if len(batch.events) > settings.max_feedback_batch:
        raise ApiError(
            413,
            f"A batch carries at most {settings.max_feedback_batch} events; "
            f"this one has {len(batch.events)}.",
            type="request_too_large",
            code="batch_too_large",
            param="events",
        )
    privacy = principal.privacy_mode or request.headers.get("x-rtrl-privacy") == "1"
    try:
        return await accept_feedback(
            request.app.state.redis,
            request.app.state.sink,
            batch.events,
            api_key_id=principal.key_id,
            privacy=privacy,
        )
    except RedisError:
        raise ApiError(
            503,
            "Feedback cannot be checked right now; retry the batch (it is idempotent).",
            type="service_unavailable",
            code="redis_unavailable",
            headers={"Retry-After": "1"},
        ) from None


def _batch(raw: bytes) -> FeedbackBatch:
    try:
        return FeedbackBatch.model_validate(orjson.loads(raw))
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise ApiError(
            422, f"{param or 'body'}: {error['msg']}", code="invalid_body", param=param
        ) from None
