"""A session id is the client's choice, so two keys can choose the same one: a session's end
finalizes the completions of the key that ended it, never another key's (real Kafka, worker,
Postgres)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from tests.workers.conftest import Events


def test_one_keys_session_end_leaves_another_keys_rewards_in_the_same_session_open(
    events: Events,
    publish: Callable[..., None],
    worker_thread: Any,
    read_rewards: Callable[[str], dict[str, Any]],
    wait_for: Callable[..., None],
) -> None:
    alice, bob = uuid.uuid4(), uuid.uuid4()
    answer = {"edit_requested": False, "proposed_edit": False, "session": 1}
    publish(
        events.completion(1, api_key_id=alice, **answer),
        events.completion(2, api_key_id=bob, **answer),
        events.session_end(2, session=1).model_copy(update={"api_key_id": bob}),
    )
    worker_thread()

    def bobs_final() -> bool:
        found = read_rewards(events.prefix)
        return len(found) == 2 and found[events.request(2)].finalized_at is not None

    wait_for(bobs_final, 60, "bob's reward to be final")
    found = read_rewards(events.prefix)
    assert found[events.request(2)].finalize_reason == "session_end"
    # Alice's session has not ended, whatever bob's session id was.
    assert found[events.request(1)].finalized_at is None

    # An end logged before keys were recorded still ends the whole session.
    publish(events.session_end(1, session=1, after_s=90))
    wait_for(
        lambda: read_rewards(events.prefix)[events.request(1)].finalized_at is not None,
        60,
        "alice's reward to be final after a keyless end",
    )
