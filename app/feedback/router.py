"""`POST /v1/feedback`: what the IDE saw happen to the completions it was served."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError

from app.auth.schemas import Principal
from app.feedback.schemas import FeedbackAccepted, FeedbackBatch
from app.feedback.service import FeedbackLimits, accept_feedback
from app.http.bodies import parse_body
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.state import app_state
from app.models import Role

router = APIRouter(prefix="/v1", tags=["feedback"])


@router.post("/feedback", status_code=202, response_model=FeedbackAccepted)
async def post_feedback(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> FeedbackAccepted:
    """Queue a batch of IDE events; any invalid event rejects the batch with 422.

    Events are idempotent by `event_id`: a resent batch is answered 202 again and counted
    as duplicates. An event on a request this key was not served is answered 404. An event
    past the key's limit for its kind on its request (`RTRL_FEEDBACK_*_PER_REQUEST`) is
    answered 409 `feedback_limit_reached`, naming it in `param`. Each event is stamped with
    the time the gateway received it (`received_at`). Follow-up messages on a privacy-mode
    completion (or sent with `X-Rtrl-Privacy: 1`, or by a privacy-mode key) are classified
    here and their text is dropped.
    """
    state = app_state(request.app)
    settings = state.settings
    batch = parse_body(await request.body(), FeedbackBatch)
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
            state.redis,
            state.sink,
            batch.events,
            api_key_id=principal.key_id,
            privacy=privacy,
            limits=FeedbackLimits.from_settings(settings),
        )
    except RedisError:
        raise ApiError.service_unavailable(
            "Feedback cannot be checked right now; retry the batch (it is idempotent).",
            code="redis_unavailable",
            retry_after_s=1,
        ) from None
