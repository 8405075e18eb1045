import assert from "node:assert/strict";
import { test } from "node:test";
import { chatHeaders, isValidId, newSessionId, servedRequest } from "../../src/index.js";

test("session ids are fresh and in the gateway's alphabet", () => {
  const ids = new Set(Array.from({ length: 50 }, () => newSessionId("vscode")));
  assert.equal(ids.size, 50);
  for (const id of ids) {
    assert.match(id, /^vscode-[0-9a-f-]{36}$/);
    assert.ok(isValidId(id));
  }
  assert.throws(() => newSessionId("no spaces"), RangeError);
});

test("chat headers carry the key, the ids and the optional flags", () => {
  const headers = chatHeaders({
    apiKey: "rtrl_ide_secret",
    sessionId: "s-1",
    requestId: "r-1",
    userId: "user@example.com",
    privacy: true,
    editRequest: false,
    parentRequestId: "r-0",
  });
  assert.deepEqual(headers, {
    Authorization: "Bearer rtrl_ide_secret",
    "Content-Type": "application/json",
    "X-Session-Id": "s-1",
    "X-Request-Id": "r-1",
    "X-User-Id": "user@example.com",
    "X-Rtrl-Privacy": "1",
    "X-Rtrl-Edit-Request": "0",
    "X-Rtrl-Parent-Request-Id": "r-0",
  });
  assert.deepEqual(chatHeaders({ apiKey: "k" }), {
    Authorization: "Bearer k",
    "Content-Type": "application/json",
  });
});

test("an id the gateway would answer 400 is refused before sending", () => {
  assert.throws(() => chatHeaders({ apiKey: "k", sessionId: "has space" }), RangeError);
  assert.throws(() => chatHeaders({ apiKey: "k", requestId: "x".repeat(129) }), RangeError);
  assert.throws(() => chatHeaders({ apiKey: "k", userId: "" }), RangeError);
  assert.doesNotThrow(() => chatHeaders({ apiKey: "k", userId: "u".repeat(256) }));
});

test("the served ids are read back from the response headers", () => {
  const response = new Response(null, {
    headers: { "X-Request-Id": "r-9", "X-Rtrl-Session-Id": "auto-abc", "X-Rtrl-Checkpoint": "ckpt-7" },
  });
  assert.deepEqual(servedRequest(response), {
    requestId: "r-9",
    sessionId: "auto-abc",
    checkpoint: "ckpt-7",
  });
  assert.throws(() => servedRequest(new Response(null)), /X-Request-Id/);
});
