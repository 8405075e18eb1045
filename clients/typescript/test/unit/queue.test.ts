import assert from "node:assert/strict";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type TestContext, test } from "node:test";
import {
  type DropReason,
  type FeedbackEvent,
  type FeedbackEventInput,
  FeedbackQueue,
  type FeedbackQueueOptions,
  FileStorage,
  MemoryStorage,
  retryAfterMs,
} from "../../src/index.js";
import { type Answer, FakeGateway, apiError, settle } from "../support/fake-gateway.js";

const T0 = Date.UTC(2025, 0, 6, 9, 0, 0);
const UUID4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

function accepted(request: number): FeedbackEventInput {
  return { kind: "edit_accepted", session_id: "s-1", request_id: `r-${request}` };
}

async function openQueue(
  t: TestContext,
  answers: Answer[] = [],
  options: Partial<FeedbackQueueOptions> = {},
): Promise<{ queue: FeedbackQueue; gateway: FakeGateway; dropped: Array<[FeedbackEvent[], DropReason]> }> {
  t.mock.timers.enable({ apis: ["setTimeout", "Date"], now: T0 });
  const gateway = new FakeGateway(answers);
  const dropped: Array<[FeedbackEvent[], DropReason]> = [];
  const queue = await FeedbackQueue.open({
    gatewayUrl: "https://rtrl.example.com/",
    apiKey: "rtrl_ide_secret",
    storage: new MemoryStorage(),
    fetch: gateway.fetch,
    random: () => 0.5,
    onDropped: (events, reason) => dropped.push([[...events], reason]),
    ...options,
  });
  t.after(() => queue.close());
  return { queue, gateway, dropped };
}

test("an event gets a v4 event id and a timestamp when queued, and only its schema's fields", async (t) => {
  const { queue } = await openQueue(t);
  const event = await queue.enqueue({ ...accepted(1), extra: "dropped" } as unknown as FeedbackEventInput);
  assert.match(event.event_id, UUID4);
  assert.deepEqual(event, {
    kind: "edit_accepted",
    event_id: event.event_id,
    session_id: "s-1",
    request_id: "r-1",
    occurred_at: new Date(T0).toISOString(),
  });
  await assert.rejects(queue.enqueue({ ...accepted(2), session_id: "not valid" }), RangeError);
  await assert.rejects(
    queue.enqueue({
      kind: "edit_survival",
      session_id: "s-1",
      request_id: "r-1",
      elapsed_s: 30,
      surviving_share: 1.5,
    }),
    RangeError,
  );
  await assert.rejects(queue.enqueue({ ...accepted(3), occurred_at: "2025-01-06T09:00:00" }), RangeError);
  assert.equal(queue.pending.length, 1);
});

test("queued events are sent in one batch when the flush interval has passed", async (t) => {
  const { queue, gateway } = await openQueue(t, [], { flushIntervalMs: 5_000 });
  await queue.enqueue(accepted(1));
  await queue.enqueue(accepted(2));
  t.mock.timers.tick(4_999);
  await settle();
  assert.equal(gateway.batches.length, 0);
  t.mock.timers.tick(1);
  await settle();
  assert.deepEqual(
    gateway.batches.map((batch) => batch.map((e) => e.request_id)),
    [["r-1", "r-2"]],
  );
  assert.equal(gateway.headers[0]?.Authorization, "Bearer rtrl_ide_secret");
  assert.equal(queue.pending.length, 0);
});

test("the queue survives a reload: a new queue on the same storage sends the same event ids", async (t) => {
  const storage = new MemoryStorage();
  const { queue: first, gateway: unreachable } = await openQueue(t, ["network error"], { storage });
  const queued = [await first.enqueue(accepted(1)), await first.enqueue(accepted(2))];
  const outcome = await first.flush();
  assert.equal(outcome.remaining, 2);
  await first.close();

  const restarted = new FakeGateway();
  const second = await FeedbackQueue.open({
    gatewayUrl: "https://rtrl.example.com",
    apiKey: "k",
    storage,
    fetch: restarted.fetch,
  });
  assert.deepEqual(second.pending, queued);
  assert.deepEqual(await second.flush(), {
    accepted: 2,
    duplicates: 0,
    dropped: 0,
    remaining: 0,
    retryInMs: null,
  });
  assert.deepEqual(restarted.sentIds, unreachable.sentIds);
  assert.deepEqual(JSON.parse(storage.value ?? "").events, []);
  await second.close();
});

test("retries keep the event ids, back off exponentially with jitter, and stop once accepted", async (t) => {
  const { queue, gateway } = await openQueue(t, ["network error", { status: 500 }, { status: 408 }], {
    initialBackoffMs: 1_000,
  });
  await queue.enqueue(accepted(1));
  const outcome = await queue.flush();
  // random() = 0.5 draws the middle of the upper half of each ceiling: 0.75 × 1 s, 2 s, 4 s.
  assert.equal(outcome.retryInMs, 750);
  for (const delay of [750, 1_500, 3_000]) {
    const sent = gateway.batches.length;
    t.mock.timers.tick(delay - 1);
    await settle();
    assert.equal(gateway.batches.length, sent);
    t.mock.timers.tick(1);
    await settle();
    assert.equal(gateway.batches.length, sent + 1);
  }
  assert.equal(queue.pending.length, 0);
  const [ids] = gateway.sentIds;
  assert.ok(gateway.sentIds.every((sent) => sent.length === 1 && sent[0] === ids?.[0]));
  t.mock.timers.tick(3_600_000);
  await settle();
  assert.equal(gateway.batches.length, 4);
});

test("the backoff stops growing at its ceiling", async (t) => {
  const failures: Answer[] = Array.from({ length: 6 }, () => ({ status: 502 }));
  const { queue } = await openQueue(t, failures, {
    initialBackoffMs: 1_000,
    maxBackoffMs: 4_000,
    random: () => 1,
  });
  await queue.enqueue(accepted(1));
  const delays = [];
  for (let attempt = 0; attempt < 5; attempt++) delays.push((await queue.flush()).retryInMs);
  assert.deepEqual(delays, [1_000, 2_000, 4_000, 4_000, 4_000]);
});

test("Retry-After is honoured on 503 and 429", async (t) => {
  const { queue, gateway } = await openQueue(t, [
    { status: 503, headers: { "Retry-After": "7" }, body: apiError("redis_unavailable") },
    { status: 429, headers: { "Retry-After": new Date(T0 + 7_000 + 12_000).toUTCString() } },
  ]);
  await queue.enqueue(accepted(1));
  assert.equal((await queue.flush()).retryInMs, 7_000);
  t.mock.timers.tick(6_999);
  await settle();
  assert.equal(gateway.batches.length, 1);
  t.mock.timers.tick(1);
  await settle();
  assert.equal(gateway.batches.length, 2);
  t.mock.timers.tick(11_999);
  await settle();
  assert.equal(gateway.batches.length, 2);
  t.mock.timers.tick(1);
  await settle();
  assert.equal(gateway.batches.length, 3);
  assert.equal(queue.pending.length, 0);
  assert.equal(retryAfterMs("soon", T0), null);
});

test("a refusal naming one event drops that event and sends the rest again", async (t) => {
  const { queue, gateway, dropped } = await openQueue(t, [
    { status: 422, body: apiError("session_mismatch", "events[1].session_id") },
  ]);
  const events = [
    await queue.enqueue(accepted(1)),
    await queue.enqueue(accepted(2)),
    await queue.enqueue(accepted(3)),
  ];
  const outcome = await queue.flush();
  assert.deepEqual(outcome, { accepted: 2, duplicates: 0, dropped: 1, remaining: 0, retryInMs: null });
  assert.deepEqual(dropped, [
    [[events[1]], { kind: "refused", status: 422, code: "session_mismatch", message: "session_mismatch" }],
  ]);
  assert.deepEqual(gateway.sentIds[1], [events[0]?.event_id, events[2]?.event_id]);
});

test("a refusal of the whole batch drops it, reported, and is never retried", async (t) => {
  const { queue, gateway, dropped } = await openQueue(t, [
    { status: 401, body: apiError("invalid_api_key") },
  ]);
  await queue.enqueue(accepted(1));
  await queue.enqueue(accepted(2));
  const outcome = await queue.flush();
  assert.deepEqual(outcome, { accepted: 0, duplicates: 0, dropped: 2, remaining: 0, retryInMs: null });
  assert.equal(dropped[0]?.[0].length, 2);
  assert.deepEqual(dropped[0]?.[1], {
    kind: "refused",
    status: 401,
    code: "invalid_api_key",
    message: "invalid_api_key",
  });
  t.mock.timers.tick(3_600_000);
  await settle();
  assert.equal(gateway.batches.length, 1);
});

test("a 404 for an unknown request id drops the event it names", async (t) => {
  const { queue, dropped } = await openQueue(t, [
    { status: 404, body: apiError("unknown_request_id", "events[0].request_id") },
  ]);
  await queue.enqueue(accepted(1));
  await queue.enqueue(accepted(2));
  assert.equal((await queue.flush()).accepted, 1);
  assert.deepEqual(
    dropped.map(([events, reason]) => [events[0]?.request_id, reason.kind]),
    [["r-1", "refused"]],
  );
});

test("batches hold at most 500 events", async (t) => {
  const { queue, gateway } = await openQueue(t, [], { maxQueued: 5_000 });
  for (let request = 0; request < 1_201; request++) void queue.enqueue(accepted(request));
  await queue.flush();
  assert.deepEqual(
    gateway.batches.map((batch) => batch.length),
    [500, 500, 201],
  );
});

test("a batch the gateway finds too large is halved", async (t) => {
  const { queue: small, gateway: strict } = await openQueue(t, [
    { status: 413, body: apiError("batch_too_large", "events") },
  ]);
  for (let request = 0; request < 6; request++) void small.enqueue(accepted(request));
  assert.equal((await small.flush()).accepted, 6);
  assert.deepEqual(
    strict.batches.map((batch) => batch.length),
    [6, 3, 3],
  );
});

test("past its cap the queue drops its oldest events, reported", async (t) => {
  const { queue, dropped } = await openQueue(t, [], { maxQueued: 3 });
  const events = [];
  for (let request = 1; request <= 5; request++) events.push(await queue.enqueue(accepted(request)));
  assert.deepEqual(queue.pending, events.slice(2));
  assert.deepEqual(dropped, [
    [[events[0]], { kind: "overflow" }],
    [[events[1]], { kind: "overflow" }],
  ]);
});

test("a file storage writes atomically and a new queue reads it back", async (t) => {
  const folder = await mkdtemp(join(tmpdir(), "rtrl-queue-"));
  t.after(() => rm(folder, { recursive: true, force: true }));
  const storage = new FileStorage(join(folder, "state", "feedback.json"));
  assert.equal(await storage.get(), undefined);
  const { queue } = await openQueue(t, ["network error"], { storage });
  const event = await queue.enqueue(accepted(1));
  await queue.close();
  assert.deepEqual(await readdir(join(folder, "state")), ["feedback.json"], "no temporary file is left");
  const reopened = await FeedbackQueue.open({
    gatewayUrl: "http://x",
    apiKey: "k",
    storage: new FileStorage(storage.path),
  });
  assert.deepEqual(reopened.pending, [event]);
  await reopened.close();
});

test("unreadable storage is reported and the queue starts empty", async (t) => {
  const folder = await mkdtemp(join(tmpdir(), "rtrl-queue-"));
  t.after(() => rm(folder, { recursive: true, force: true }));
  await writeFile(join(folder, "feedback.json"), "{not json");
  const errors: unknown[] = [];
  const queue = await FeedbackQueue.open({
    gatewayUrl: "http://x",
    apiKey: "k",
    storage: new FileStorage(join(folder, "feedback.json")),
    onStorageError: (error) => errors.push(error),
  });
  assert.equal(queue.pending.length, 0);
  assert.ok(errors[0] instanceof SyntaxError);
  await queue.close();
  const emptied = await FeedbackQueue.open({
    gatewayUrl: "http://x",
    apiKey: "k",
    storage: new MemoryStorage("null"),
    onStorageError: (error) => errors.push(error),
  });
  assert.equal(emptied.pending.length, 0);
  assert.ok(errors[1] instanceof TypeError);
  await emptied.close();
});
