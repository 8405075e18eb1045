import assert from "node:assert/strict";
import { writeFile } from "node:fs/promises";
import { test } from "node:test";
import {
  type DropReason,
  EditSurvivalTracker,
  FeedbackQueue,
  MemoryStorage,
  type SurvivalReport,
  chatHeaders,
  newSessionId,
  servedRequest,
  survivalFeedback,
} from "../../src/index.js";

/**
 * Against a running gateway: RTRL_GATEWAY_URL, RTRL_API_KEY (an `ide` key), and
 * RTRL_RESULT_FILE, where the ids and events sent are written for the caller to check.
 */
const gatewayUrl = process.env.RTRL_GATEWAY_URL ?? "";
const apiKey = process.env.RTRL_API_KEY ?? "";
const resultFile = process.env.RTRL_RESULT_FILE ?? "";

test(
  "a served completion's acceptance and survival windows reach the gateway once",
  { skip: gatewayUrl === "" || apiKey === "" ? "RTRL_GATEWAY_URL and RTRL_API_KEY name no gateway" : false },
  async (t) => {
    const sessionId = newSessionId("it");
    const response = await fetch(`${gatewayUrl}/v1/chat/completions`, {
      method: "POST",
      headers: chatHeaders({ apiKey, sessionId, userId: "typescript-client" }),
      body: JSON.stringify({
        model: "rtrl",
        messages: [{ role: "user", content: "Write f(x) that returns x plus 3." }],
        max_tokens: 8,
      }),
    });
    assert.equal(response.status, 200, await response.clone().text());
    const served = servedRequest(response);
    assert.equal(served.sessionId, sessionId);
    assert.ok(served.checkpoint);
    const { requestId } = served;

    const storage = new MemoryStorage();
    const queue = await FeedbackQueue.open({ gatewayUrl, apiKey, storage, flushIntervalMs: 3_600_000 });
    await queue.enqueue({ kind: "edit_accepted", session_id: sessionId, request_id: requestId });

    t.mock.timers.enable({ apis: ["setTimeout", "Date"], now: Date.now() });
    const reports: SurvivalReport[] = [];
    const queued: Array<Promise<unknown>> = [];
    const tracker = new EditSurvivalTracker({
      onReport: (report) => {
        reports.push(report);
        queued.push(queue.enqueue(survivalFeedback(report)));
      },
    });
    // The AI's line, accepted after "def f(x):\n".
    const uri = "file:///workspace/f.py";
    tracker.trackAcceptedEdit({
      requestId,
      sessionId,
      documentUri: uri,
      offset: 10,
      text: "    return x + 3\n",
    });
    // Two comment lines typed above move the line to offset 26.
    tracker.documentChanged({
      uri,
      changes: [{ rangeOffset: 0, rangeLength: 0, text: "# adds 3\n# to x\n" }],
    });
    t.mock.timers.tick(30_000);
    // The user changes the AI's "3" (at 26 + 15) to "4": 12 of the line's 14 four-grams stay.
    tracker.documentChanged({ uri, changes: [{ rangeOffset: 41, rangeLength: 1, text: "4" }] });
    t.mock.timers.tick(90_000);
    tracker.documentClosed(uri);
    t.mock.timers.reset();
    await Promise.all(queued);
    assert.deepEqual(
      reports.map((r) => [r.elapsedS, r.censored ? null : r.survivingShare]),
      [
        [30, 1],
        [120, 12 / 14],
        [300, null],
        [600, null],
        [900, null],
      ],
    );

    const sent = storage.value ?? "";
    assert.deepEqual(await queue.flush(), {
      accepted: 6,
      duplicates: 0,
      dropped: 0,
      remaining: 0,
      retryInMs: null,
    });
    await queue.close();

    // The same stored queue sent again, as after a reload that lost the gateway's answer.
    const resent = await FeedbackQueue.open({ gatewayUrl, apiKey, storage: new MemoryStorage(sent) });
    assert.deepEqual(await resent.flush(), {
      accepted: 0,
      duplicates: 6,
      dropped: 0,
      remaining: 0,
      retryInMs: null,
    });
    await resent.close();

    // Feedback on a request this key was never served is refused for good: dropped, not retried.
    const dropped: Array<[number, DropReason]> = [];
    const stray = await FeedbackQueue.open({
      gatewayUrl,
      apiKey,
      storage: new MemoryStorage(),
      onDropped: (events, reason) => dropped.push([events.length, reason]),
    });
    await stray.enqueue({
      kind: "edit_rejected",
      session_id: sessionId,
      request_id: `never-served-${requestId}`,
    });
    assert.deepEqual(await stray.flush(), {
      accepted: 0,
      duplicates: 0,
      dropped: 1,
      remaining: 0,
      retryInMs: null,
    });
    assert.deepEqual(
      dropped.map(([count, reason]) => [
        count,
        reason.kind === "refused" ? [reason.status, reason.code] : null,
      ]),
      [[1, [404, "unknown_request_id"]]],
    );
    await stray.close();

    if (resultFile !== "") {
      const { events } = JSON.parse(sent) as { events: unknown[] };
      await writeFile(resultFile, JSON.stringify({ request_id: requestId, session_id: sessionId, events }));
    }
  },
);
