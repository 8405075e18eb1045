import { randomUUID } from "node:crypto";
import { type Clock, systemClock } from "./clock.js";
import { type FeedbackEvent, type FeedbackEventInput, feedbackEvent } from "./events.js";
import type { FeedbackStorage } from "./storage.js";

/** The most events the gateway takes in one `POST /v1/feedback`. */
export const MAX_BATCH = 500;

/** Why events left the queue without being accepted. */
export type DropReason =
  /** The gateway refused them for good (a 4xx other than 408 and 429). */
  | { kind: "refused"; status: number; code: string | null; message: string }
  /** The queue was over its cap; the oldest events went first. */
  | { kind: "overflow" };

export interface FeedbackQueueOptions {
  /** The gateway's base URL, e.g. `https://rtrl.example.com`. */
  gatewayUrl: string;
  apiKey: string;
  storage: FeedbackStorage;
  /** Sends every batch with `X-Rtrl-Privacy: 1`. */
  privacy?: boolean;
  fetch?: typeof fetch;
  clock?: Clock;
  /** In [0, 1); draws the backoff jitter. */
  random?: () => number;
  /** How long an enqueued event waits for company before it is sent. Default 5 s. */
  flushIntervalMs?: number;
  /** Default 500, the gateway's limit. */
  maxBatch?: number;
  /** The most events kept; past it the oldest are dropped. Default 10,000. */
  maxQueued?: number;
  /** The first retry's delay; each failure in a row doubles it. Default 1 s. */
  initialBackoffMs?: number;
  /** Default 5 min. */
  maxBackoffMs?: number;
  /** How long one request may take before it counts as a network error. Default 30 s. */
  requestTimeoutMs?: number;
  onAccepted?: (events: readonly FeedbackEvent[], answer: FeedbackAnswer) => void;
  onDropped?: (events: readonly FeedbackEvent[], reason: DropReason) => void;
  /** The storage failed; the events stay queued in memory. */
  onStorageError?: (error: unknown) => void;
}

/** The gateway's answer to an accepted batch. */
export interface FeedbackAnswer {
  accepted: number;
  duplicates: number;
}

/** What one `flush()` did. */
export interface FlushOutcome extends FeedbackAnswer {
  dropped: number;
  /** Events still queued: a retry is scheduled (`retryInMs`) unless the queue is empty. */
  remaining: number;
  retryInMs: number | null;
}

type Delivery =
  | { kind: "accepted"; answer: FeedbackAnswer }
  | { kind: "retry"; delayMs: number | null }
  | { kind: "refused"; status: number; code: string | null; message: string; eventIndex: number | null }
  | { kind: "too_large"; status: number; code: string | null; message: string };

interface StoredQueue {
  version: 1;
  events: FeedbackEvent[];
}

/** Statuses that say "later", not "never". */
const RETRIABLE = new Set([408, 429]);
/** `events[3]` or `events[3].request_id`: the one event a refusal names. */
const EVENT_PARAM = /^events\[(\d+)\]/;

/**
 * Feedback events on their way to the gateway: persisted at once, sent in batches, retried
 * with backoff until the gateway accepts or refuses them. Each event gets its `event_id` when
 * enqueued and keeps it on every retry, so a batch resent after a lost answer is counted as
 * duplicates by the gateway, never twice.
 */
export class FeedbackQueue {
  private readonly options: FeedbackQueueOptions;
  private readonly clock: Clock;
  private readonly fetch: typeof fetch;
  private events: FeedbackEvent[];
  private batchSize: number;
  private failures = 0;
  private timer: unknown = null;
  private flushing: Promise<FlushOutcome> | null = null;
  private writes: Promise<void> = Promise.resolve();
  private nextWrite: Promise<void> | null = null;
  private closed = false;

  private constructor(options: FeedbackQueueOptions, events: FeedbackEvent[]) {
    this.options = options;
    this.clock = options.clock ?? systemClock;
    this.fetch = options.fetch ?? globalThis.fetch;
    this.events = events;
    this.batchSize = Math.min(options.maxBatch ?? MAX_BATCH, MAX_BATCH);
  }

  /** The queue with whatever an earlier run left in `storage`; its flush timer starts if that is not empty. */
  static async open(options: FeedbackQueueOptions): Promise<FeedbackQueue> {
    let events: FeedbackEvent[] = [];
    try {
      const stored = await options.storage.get();
      if (stored !== undefined) {
        const parsed = JSON.parse(stored) as Partial<StoredQueue> | null;
        if (!Array.isArray(parsed?.events))
          throw new TypeError("The stored feedback queue has no events list");
        events = parsed.events;
      }
    } catch (error) {
      options.onStorageError?.(error);
    }
    const queue = new FeedbackQueue(options, events);
    queue.scheduleFlush();
    return queue;
  }

  /** Events waiting to be sent, oldest first. */
  get pending(): readonly FeedbackEvent[] {
    return this.events;
  }

  /**
   * Queues an event under a new `event_id` and persists the queue; resolves with the event
   * once stored. Throws RangeError, before queueing, on an event the gateway would refuse.
   */
  async enqueue(input: FeedbackEventInput): Promise<FeedbackEvent> {
    if (this.closed) throw new Error("The feedback queue is closed");
    const event = feedbackEvent(input, randomUUID(), new Date(this.clock.now()).toISOString());
    this.events.push(event);
    const cap = this.options.maxQueued ?? 10_000;
    if (this.events.length > cap) {
      const oldest = this.events.splice(0, this.events.length - cap);
      this.options.onDropped?.(oldest, { kind: "overflow" });
    }
    const stored = this.persist();
    this.scheduleFlush();
    await stored;
    return event;
  }

  /**
   * Sends everything queued now, whatever backoff was pending, until the queue is empty or
   * the gateway asks to wait (then a retry is scheduled). A flush already under way is joined.
   */
  flush(): Promise<FlushOutcome> {
    if (this.flushing === null) {
      this.cancelTimer();
      this.flushing = this.sendAll().finally(() => {
        this.flushing = null;
        this.scheduleFlush();
      });
    }
    return this.flushing;
  }

  /** Stops the timers and waits for the queue's last write; what is still queued stays stored. */
  async close(): Promise<void> {
    this.closed = true;
    this.cancelTimer();
    await this.flushing?.catch(() => undefined);
    await this.writes;
  }

  private async sendAll(): Promise<FlushOutcome> {
    const outcome: FlushOutcome = { accepted: 0, duplicates: 0, dropped: 0, remaining: 0, retryInMs: null };
    while (this.events.length > 0) {
      const batch = this.events.slice(0, this.batchSize);
      const delivery = await this.deliver(batch);
      if (delivery.kind === "retry") {
        this.failures += 1;
        outcome.retryInMs = delivery.delayMs ?? this.backoffMs();
        this.schedule(outcome.retryInMs);
        break;
      }
      this.failures = 0;
      if (delivery.kind === "accepted") {
        this.remove(batch);
        outcome.accepted += delivery.answer.accepted;
        outcome.duplicates += delivery.answer.duplicates;
        this.options.onAccepted?.(batch, delivery.answer);
      } else if (delivery.kind === "too_large" && batch.length > 1) {
        this.batchSize = Math.ceil(batch.length / 2);
        continue;
      } else {
        // Only the event a refusal names is dropped; the others go in the next batch.
        const index = delivery.kind === "refused" ? delivery.eventIndex : null;
        const refused = index !== null && index < batch.length ? [batch[index]!] : batch;
        this.remove(refused);
        outcome.dropped += refused.length;
        const { status, code, message } = delivery;
        this.options.onDropped?.(refused, { kind: "refused", status, code, message });
      }
      await this.persist().catch(() => undefined);
    }
    outcome.remaining = this.events.length;
    return outcome;
  }

  private async deliver(batch: readonly FeedbackEvent[]): Promise<Delivery> {
    const headers: Record<string, string> = {
      Authorization: `Bearer ${this.options.apiKey}`,
      "Content-Type": "application/json",
    };
    if (this.options.privacy) headers["X-Rtrl-Privacy"] = "1";
    let response: Response;
    try {
      response = await this.fetch(`${this.options.gatewayUrl.replace(/\/+$/, "")}/v1/feedback`, {
        method: "POST",
        headers,
        body: JSON.stringify({ events: batch }),
        signal: AbortSignal.timeout(this.options.requestTimeoutMs ?? 30_000),
      });
    } catch {
      return { kind: "retry", delayMs: null };
    }
    if (response.ok) {
      const answer = (await response.json().catch(() => ({}))) as Partial<FeedbackAnswer>;
      return {
        kind: "accepted",
        answer: { accepted: answer.accepted ?? batch.length, duplicates: answer.duplicates ?? 0 },
      };
    }
    if (response.status >= 500 || RETRIABLE.has(response.status)) {
      await response.body?.cancel().catch(() => undefined);
      return { kind: "retry", delayMs: retryAfterMs(response.headers.get("Retry-After"), this.clock.now()) };
    }
    const error = await apiError(response);
    if (response.status === 413) return { kind: "too_large", status: response.status, ...error };
    const match = error.param === null ? null : EVENT_PARAM.exec(error.param);
    return {
      kind: "refused",
      status: response.status,
      code: error.code,
      message: error.message,
      eventIndex: match ? Number(match[1]) : null,
    };
  }

  /** Exponential, with the delay drawn from its upper half so that many IDEs do not retry in step. */
  private backoffMs(): number {
    const initial = this.options.initialBackoffMs ?? 1_000;
    const ceiling = Math.min(this.options.maxBackoffMs ?? 300_000, initial * 2 ** (this.failures - 1));
    return Math.round(ceiling / 2 + (ceiling / 2) * (this.options.random ?? Math.random)());
  }

  private remove(events: readonly FeedbackEvent[]): void {
    const ids = new Set(events.map((event) => event.event_id));
    this.events = this.events.filter((event) => !ids.has(event.event_id));
  }

  /** Stores the queue as it is when the write starts: writes asked for while one waits share it. */
  private persist(): Promise<void> {
    if (this.nextWrite === null) {
      const write = this.writes.then(() => {
        this.nextWrite = null;
        return this.options.storage.set(
          JSON.stringify({ version: 1, events: this.events } satisfies StoredQueue),
        );
      });
      this.nextWrite = write;
      this.writes = write.catch((error: unknown) => this.options.onStorageError?.(error));
    }
    return this.nextWrite;
  }

  private scheduleFlush(): void {
    if (this.timer === null && this.flushing === null && !this.closed && this.events.length > 0) {
      this.schedule(this.options.flushIntervalMs ?? 5_000);
    }
  }

  private schedule(delayMs: number): void {
    this.cancelTimer();
    if (this.closed) return;
    this.timer = this.clock.setTimeout(() => {
      this.timer = null;
      void this.flush();
    }, delayMs);
  }

  private cancelTimer(): void {
    if (this.timer !== null) {
      this.clock.clearTimeout(this.timer);
      this.timer = null;
    }
  }
}

/** `Retry-After` as milliseconds from now: delta-seconds or an HTTP date; null when absent or unreadable. */
export function retryAfterMs(header: string | null, nowMs: number): number | null {
  if (header === null) return null;
  const trimmed = header.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed) * 1000;
  const date = Date.parse(trimmed);
  return Number.isNaN(date) ? null : Math.max(0, date - nowMs);
}

async function apiError(
  response: Response,
): Promise<{ code: string | null; message: string; param: string | null }> {
  const text = await response.text().catch(() => "");
  try {
    const { error } = JSON.parse(text) as { error?: { code?: string; message?: string; param?: string } };
    return { code: error?.code ?? null, message: error?.message ?? text, param: error?.param ?? null };
  } catch {
    return { code: null, message: text, param: null };
  }
}
