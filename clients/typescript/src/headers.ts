import { randomUUID } from "node:crypto";

/** The gateway's alphabet for session, request and user ids. */
const ID_CHARS = /^[A-Za-z0-9._:@-]+$/;
const MAX_ID_LENGTH = 128;
const MAX_USER_ID_LENGTH = 256;

/** Whether `value` is a session or request id the gateway accepts. */
export function isValidId(value: string, maxLength = MAX_ID_LENGTH): boolean {
  return value.length >= 1 && value.length <= maxLength && ID_CHARS.test(value);
}

function checkedId(name: string, value: string, maxLength = MAX_ID_LENGTH): string {
  if (!isValidId(value, maxLength)) {
    throw new RangeError(`${name} must be 1-${maxLength} characters of A-Z a-z 0-9 . _ : @ -`);
  }
  return value;
}

/** A fresh id for one IDE session (one window, from activation to shutdown). */
export function newSessionId(prefix = "ide"): string {
  return checkedId("A session id", `${prefix}-${randomUUID()}`);
}

/** A fresh request id; unique forever, as the gateway requires. */
export function newRequestId(): string {
  return randomUUID();
}

export interface ChatRequestOptions {
  apiKey: string;
  /** The IDE session; the key of every event logged for its requests. */
  sessionId?: string;
  /** Chosen by the IDE to know the id before the answer; the gateway makes one otherwise. */
  requestId?: string;
  /** The IDE's stable user id (at most 256 characters). */
  userId?: string;
  /** Nothing of the prompt or answer is logged. */
  privacy?: boolean;
  /** Whether the user asked for an edit; the gateway guesses from the message otherwise. */
  editRequest?: boolean;
  /** The request whose conversation this one continues. */
  parentRequestId?: string;
}

/** The headers of a `POST /v1/chat/completions`; throws RangeError on an id the gateway refuses. */
export function chatHeaders(options: ChatRequestOptions): Record<string, string> {
  const headers: Record<string, string> = {
    Authorization: `Bearer ${options.apiKey}`,
    "Content-Type": "application/json",
  };
  if (options.sessionId !== undefined) {
    headers["X-Session-Id"] = checkedId("The session id", options.sessionId);
  }
  if (options.requestId !== undefined) {
    headers["X-Request-Id"] = checkedId("The request id", options.requestId);
  }
  if (options.userId !== undefined) {
    headers["X-User-Id"] = checkedId("The user id", options.userId, MAX_USER_ID_LENGTH);
  }
  if (options.privacy) {
    headers["X-Rtrl-Privacy"] = "1";
  }
  if (options.editRequest !== undefined) {
    headers["X-Rtrl-Edit-Request"] = options.editRequest ? "1" : "0";
  }
  if (options.parentRequestId !== undefined) {
    headers["X-Rtrl-Parent-Request-Id"] = checkedId("The parent request id", options.parentRequestId);
  }
  return headers;
}

/** What the gateway says it served: the ids feedback must name, and the checkpoint. */
export interface ServedRequest {
  requestId: string;
  /** The session the request was logged in: the one sent, or the one the gateway derived. */
  sessionId: string | null;
  checkpoint: string | null;
}

/** Reads the served ids from a chat response (a fetch `Response` or anything with its `headers`). */
export function servedRequest(response: { headers: { get(name: string): string | null } }): ServedRequest {
  const requestId = response.headers.get("X-Request-Id");
  if (requestId === null) {
    throw new Error("The response carries no X-Request-Id: it did not come from an rtrl gateway");
  }
  return {
    requestId,
    sessionId: response.headers.get("X-Rtrl-Session-Id"),
    checkpoint: response.headers.get("X-Rtrl-Checkpoint"),
  };
}
