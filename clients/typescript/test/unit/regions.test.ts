import assert from "node:assert/strict";
import { test } from "node:test";
import { type TextChange, TrackedRegion, inApplyOrder } from "../../src/index.js";

/** The document after one event, from the changes' own pre-event offsets (no reliance on their order). */
function applyEvent(document: string, changes: TextChange[]): string {
  const ascending = [...changes].sort((a, b) => a.rangeOffset - b.rangeOffset);
  let result = "";
  let at = 0;
  for (const change of ascending) {
    result += document.slice(at, change.rangeOffset) + change.text;
    at = change.rangeOffset + change.rangeLength;
  }
  return result + document.slice(at);
}

function applyToRegion(region: TrackedRegion, changes: TextChange[]): void {
  for (const change of inApplyOrder(changes)) region.apply(change);
}

test("the region follows several changes per event: before, inside, after, at its ends, across, over it", () => {
  let document = "head:alpha beta gamma:tail";
  const region = new TrackedRegion(5, "alpha beta gamma");
  const step = (changes: TextChange[], text: string, start: number, unchanged: number) => {
    document = applyEvent(document, changes);
    applyToRegion(region, changes);
    assert.equal(region.text, text);
    assert.equal(region.start, start);
    assert.equal(region.end, start + text.length);
    assert.equal(document.slice(region.start, region.end), text, "the region is where the document says");
    assert.equal(region.unchangedChars, unchanged);
  };

  // Listed from the start of the document: "XX" before, "!" inside (after "alpha "), "??" after.
  step(
    [
      { rangeOffset: 0, rangeLength: 0, text: "XX" },
      { rangeOffset: 11, rangeLength: 0, text: "!" },
      { rangeOffset: 26, rangeLength: 0, text: "??" },
    ],
    "alpha !beta gamma",
    7,
    16,
  );
  // Typed right at either end: outside, the AI did not write it.
  step(
    [
      { rangeOffset: 24, rangeLength: 0, text: ">" },
      { rangeOffset: 7, rangeLength: 0, text: "<" },
    ],
    "alpha !beta gamma",
    8,
    16,
  );
  assert.equal(document, "XXhead:<alpha !beta gamma>:tail??");
  // ":<al" becomes "=" across the start, "ma>:" becomes "MA" across the end; the
  // replacements join the region, the AI's "al" and "ma" are gone (16 - 4 = 12 unchanged).
  step(
    [
      { rangeOffset: 6, rangeLength: 4, text: "=" },
      { rangeOffset: 23, rangeLength: 4, text: "MA" },
    ],
    "=pha !beta gamMA",
    6,
    12,
  );
  // Everything from "ad" to "ta" deleted: the region is empty where it was.
  step([{ rangeOffset: 4, rangeLength: 20, text: "" }], "", 4, 0);
  assert.equal(document, "XXheil??");
  // Typing where the region was does not bring it back.
  step([{ rangeOffset: 4, rangeLength: 0, text: "new" }], "", 7, 0);
});

test("changes sent from the end backwards, as VS Code sends them, map the same", () => {
  const changes = [
    { rangeOffset: 26, rangeLength: 0, text: "??" },
    { rangeOffset: 11, rangeLength: 0, text: "!" },
    { rangeOffset: 0, rangeLength: 0, text: "XX" },
  ];
  const region = new TrackedRegion(5, "alpha beta gamma");
  applyToRegion(region, changes);
  assert.deepEqual([region.start, region.text], [7, "alpha !beta gamma"]);
});

test("deleting exactly the region leaves it empty; a change reports whether it touched the region", () => {
  const region = new TrackedRegion(5, "alpha");
  assert.equal(region.apply({ rangeOffset: 12, rangeLength: 3, text: "" }), false);
  assert.equal(region.apply({ rangeOffset: 0, rangeLength: 1, text: "ab" }), false);
  assert.deepEqual([region.start, region.end], [6, 11]);
  assert.equal(region.apply({ rangeOffset: 6, rangeLength: 5, text: "" }), true);
  assert.deepEqual([region.start, region.end, region.text, region.unchangedChars], [6, 6, "", 0]);
});

test("a replacement inside keeps the AI's characters on both sides", () => {
  const region = new TrackedRegion(0, "return x + 3");
  region.apply({ rangeOffset: 11, rangeLength: 1, text: "42" });
  assert.equal(region.text, "return x + 42");
  assert.equal(region.unchangedChars, 11);
});
