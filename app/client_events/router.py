"""`POST /v1/adapters/continue`: Continue's data destination, pointed at rtrl.

In Continue's `config.yaml`:

    data:
      - name: rtrl
        destination: https://rtrl.example.com/v1/adapters/continue
        schema: 0.2.0          # or 0.1.0
        level: all             # or noCode: then edits and chat feedback cannot be joined
        apiKey: <an ide key>
        requestOptions:
          headers:
            X-User-Id: <the developer's stable id, as sent with the model requests>

Every event is answered 202 with what became of it (mapped, duplicate, unjoinable, ignored),
and counted in `rtrl_continue_events_total`; only a body that is not a Continue event is a 4xx.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError

from app.abtest.assignment import hash_user
from app.auth.schemas import Principal
from app.client_events.schemas import ContinueEnvelope, ContinueEventOutcome
from app.client_events.service import Owner, accept_continue_event
from app.feedback.service import FeedbackLimits
from app.gateway.trajectories import run_owner
from app.http.bodies import parse_body
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.state import app_state
from app.models import Role

router = APIRouter(prefix="/v1/adapters", tags=["feedback"])

_NOT_AN_ENVELOPE = (
    '{where}: {error} (expected Continue\'s {{"name", "data", "schema", "level"}} envelope)'
)


@router.post("/continue", status_code=202, response_model=ContinueEventOutcome)
async def post_continue_event(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> ContinueEventOutcome:
    """One event of Continue's data destination, joined to the completion it is about.

    `toolUsage` of an edit tool (by its tool call id), `nextEditOutcome` (by its completion
    id), `editOutcome` and `chatFeedback` (by the answer's text, level `all` only) become
    `edit_accepted`, `edit_rejected` or a dissatisfied (thumbs down) or satisfied (thumbs up)
    follow-up; everything else is answered `ignored`. The same event posted twice is counted
    once.
    """
    state = app_state(request.app)
    settings = state.settings
    envelope = parse_body(await request.body(), ContinueEnvelope, message=_NOT_AN_ENVELOPE)
    user_id = request.headers.get("x-user-id") or str(principal.key_id)
    owner = Owner(
        api_key_id=principal.key_id,
        run_owner=run_owner(
            principal.key_id, hash_user(settings.user_hash_secret.get_secret_value(), user_id)
        ),
        privacy=principal.privacy_mode or request.headers.get("x-rtrl-privacy") == "1",
    )
    try:
        return await accept_continue_event(
            state.redis,
            state.sink,
            owner,
            envelope.name,
            envelope.data,
            FeedbackLimits.from_settings(settings),
        )
    except RedisError:
        raise ApiError.service_unavailable(
            "The event cannot be joined right now; Continue does not retry, so it is lost.",
            code="redis_unavailable",
            retry_after_s=1,
        ) from None
