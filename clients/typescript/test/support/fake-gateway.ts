import type { FeedbackEvent } from "../../src/index.js";

/** One answer of the fake gateway: a response, or a network failure. */
export type Answer = { status: number; body?: unknown; headers?: Record<string, string> } | "network error";

/** A `fetch` that records every feedback batch and answers from a script (202 once it runs out). */
export class FakeGateway {
  readonly batches: FeedbackEvent[][] = [];
  readonly headers: Array<Record<string, string>> = [];

  constructor(private readonly answers: Answer[] = []) {}

  readonly fetch = async (_url: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const { events } = JSON.parse(String(init?.body)) as { events: FeedbackEvent[] };
    this.batches.push(events);
    this.headers.push(init?.headers as Record<string, string>);
    const answer = this.answers.shift() ?? { status: 202, body: { accepted: events.length, duplicates: 0 } };
    if (answer === "network error") throw new TypeError("fetch failed");
    return new Response(answer.body === undefined ? null : JSON.stringify(answer.body), {
      status: answer.status,
      headers: answer.headers ?? {},
    });
  };

  /** The event ids of every batch sent, in order. */
  get sentIds(): string[][] {
    return this.batches.map((batch) => batch.map((event) => event.event_id));
  }
}

/** Lets the promises a timer callback started run to their end. */
export async function settle(): Promise<void> {
  for (let round = 0; round < 5; round++) await new Promise((resolve) => setImmediate(resolve));
}

/** An OpenAI-style error body, as the gateway answers. */
export function apiError(code: string, param: string | null = null, message = code): { error: object } {
  return { error: { message, type: "invalid_request_error", param, code } };
}
