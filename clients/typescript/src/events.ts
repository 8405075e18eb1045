import { isValidId } from "./headers.js";

/** The longest window a survival report may name: a week after acceptance. */
export const MAX_ELAPSED_S = 7 * 24 * 3600;
export const MAX_FOLLOWUP_CHARS = 16_000;

interface EventIds {
  /** The session the request was served in (its `X-Rtrl-Session-Id`). */
  session_id: string;
  /** The request the event is about (its `X-Request-Id`). */
  request_id: string;
  /** ISO-8601 with a timezone; the time of enqueueing when left out. */
  occurred_at?: string;
}

/** An event as the IDE reports it to `POST /v1/feedback`, before the queue gives it its id. */
export type FeedbackEventInput =
  | (EventIds & { kind: "edit_accepted" })
  | (EventIds & { kind: "edit_rejected" })
  | (EventIds & { kind: "edit_survival"; elapsed_s: number; surviving_share: number })
  | (EventIds & { kind: "edit_survival"; elapsed_s: number; censored: true; surviving_share: null })
  | (EventIds & { kind: "followup_message"; message: string })
  | (EventIds & { kind: "session_end" });

/** An event as sent: with the `event_id` that makes every resend of it a duplicate. */
export type FeedbackEvent = FeedbackEventInput & { event_id: string; occurred_at: string };

const TIMEZONE_SUFFIX = /(Z|[+-]\d{2}:?\d{2})$/i;

/**
 * The event as the gateway's schema has it, with nothing else: the gateway refuses unknown
 * fields, and one refused event costs the whole batch a round trip.
 * Throws RangeError on what the gateway would refuse.
 */
export function feedbackEvent(input: FeedbackEventInput, eventId: string, occurredAt: string): FeedbackEvent {
  const ids = {
    event_id: eventId,
    session_id: input.session_id,
    request_id: input.request_id,
    occurred_at: input.occurred_at ?? occurredAt,
  };
  if (!isValidId(ids.session_id))
    throw new RangeError(`Invalid session_id ${JSON.stringify(ids.session_id)}`);
  if (!isValidId(ids.request_id))
    throw new RangeError(`Invalid request_id ${JSON.stringify(ids.request_id)}`);
  if (!TIMEZONE_SUFFIX.test(ids.occurred_at) || Number.isNaN(Date.parse(ids.occurred_at))) {
    throw new RangeError(
      `occurred_at must be ISO-8601 with a timezone, not ${JSON.stringify(ids.occurred_at)}`,
    );
  }
  switch (input.kind) {
    case "edit_accepted":
    case "edit_rejected":
    case "session_end":
      return { kind: input.kind, ...ids };
    case "followup_message":
      if (typeof input.message !== "string" || input.message.length > MAX_FOLLOWUP_CHARS) {
        throw new RangeError(`A follow-up message is a string of at most ${MAX_FOLLOWUP_CHARS} characters`);
      }
      return { kind: input.kind, ...ids, message: input.message };
    case "edit_survival": {
      if (!(input.elapsed_s >= 0 && input.elapsed_s <= MAX_ELAPSED_S)) {
        throw new RangeError(`elapsed_s must be within 0..${MAX_ELAPSED_S}, not ${input.elapsed_s}`);
      }
      if ("censored" in input && input.censored) {
        return {
          kind: input.kind,
          ...ids,
          elapsed_s: input.elapsed_s,
          censored: true,
          surviving_share: null,
        };
      }
      const share = input.surviving_share;
      if (typeof share !== "number" || !(share >= 0 && share <= 1)) {
        throw new RangeError(`surviving_share must be within 0..1, not ${share}`);
      }
      return { kind: input.kind, ...ids, elapsed_s: input.elapsed_s, surviving_share: share };
    }
    default:
      throw new RangeError(`Unknown feedback kind ${JSON.stringify((input as { kind: unknown }).kind)}`);
  }
}
