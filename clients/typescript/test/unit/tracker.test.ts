import assert from "node:assert/strict";
import { type TestContext, test } from "node:test";
import {
  type AcceptedEdit,
  EditSurvivalTracker,
  type SurvivalReport,
  feedbackEvent,
  survivalFeedback,
} from "../../src/index.js";

const T0 = Date.UTC(2025, 0, 6, 9, 0, 0);
const URI = "file:///work/app/f.py";
/** "def f(x):\n" then the AI's line. */
const EDIT: AcceptedEdit = {
  requestId: "r-1",
  sessionId: "s-1",
  documentUri: URI,
  offset: 10,
  text: "    return x + 3\n",
};

function tracked(
  t: TestContext,
  edit: AcceptedEdit = EDIT,
): { tracker: EditSurvivalTracker; reports: SurvivalReport[] } {
  t.mock.timers.enable({ apis: ["setTimeout", "Date"], now: T0 });
  const reports: SurvivalReport[] = [];
  const tracker = new EditSurvivalTracker({ onReport: (report) => reports.push(report) });
  tracker.trackAcceptedEdit(edit);
  return { tracker, reports };
}

function measured(report: SurvivalReport | undefined): Extract<SurvivalReport, { censored: false }> {
  assert.ok(report !== undefined && !report.censored, "a measured report");
  return report;
}

test("each window is reported once, at its time after acceptance", (t) => {
  const { reports } = tracked(t);
  // Node's mock clock reads the end of a tick inside every callback it runs, so the ticks
  // stop at each window: a millisecond before it, then at it.
  let now = 0;
  for (const [index, windowS] of [30, 120, 300, 600, 900].entries()) {
    t.mock.timers.tick(windowS * 1000 - 1 - now);
    assert.equal(reports.length, index);
    t.mock.timers.tick(1);
    now = windowS * 1000;
    assert.equal(reports.length, index + 1);
    assert.deepEqual([reports[index]?.elapsedS, reports[index]?.measuredAt], [windowS, T0 + now]);
  }
  t.mock.timers.tick(24 * 3600_000);
  assert.equal(reports.length, 5);
  assert.ok(reports.every((r) => !r.censored && r.survivingShare === 1));
});

test("the scores of an edited line: one character of the AI's seventeen replaced", (t) => {
  const { tracker, reports } = tracked(t);
  t.mock.timers.tick(40_000);
  // "3" (offset 10 + 15) becomes "4".
  tracker.documentChanged({ uri: URI, changes: [{ rangeOffset: 25, rangeLength: 1, text: "4" }] });
  t.mock.timers.tick(80_000);
  const [first, second] = reports.map(measured);
  assert.equal(first?.survivingShare, 1);
  // 17 characters have 14 four-grams; the grams holding the "3" are " + 3" and "+ 3\n": 12 of 14 kept.
  assert.equal(second?.survivingShare, 12 / 14);
  assert.deepEqual(second?.scores, {
    fourGram: 12 / 14,
    noRevert: 1,
    arc: 16,
    arcShare: 16 / 17,
    levenshtein: 1 - 1 / 17,
  });
  assert.deepEqual(tracker.regionsOf("r-1"), [
    { documentUri: URI, start: 10, end: 27, text: "    return x + 4\n" },
  ]);
});

test("a closed document censors the window in progress and every later one, at once", (t) => {
  const { tracker, reports } = tracked(t);
  t.mock.timers.tick(30_000);
  t.mock.timers.tick(70_000);
  tracker.documentClosed("file:///work/app/other.py");
  assert.equal(reports.length, 1);
  tracker.documentClosed(URI);
  assert.deepEqual(
    reports.map((r) => [r.elapsedS, r.censored, r.censored ? r.censoredBecause : null, r.measuredAt - T0]),
    [
      [30, false, null, 30_000],
      [120, true, "closed", 100_000],
      [300, true, "closed", 100_000],
      [600, true, "closed", 100_000],
      [900, true, "closed", 100_000],
    ],
  );
  t.mock.timers.tick(3600_000);
  assert.equal(reports.length, 5, "no window is reported twice");
  assert.equal(tracker.isTracking(URI), false);
});

test("a censored window is sent as censored with no share, never as 0", (t) => {
  const { tracker, reports } = tracked(t);
  t.mock.timers.tick(30_000);
  tracker.dispose();
  assert.deepEqual(
    reports.map((r) => (r.censored ? r.censoredBecause : r.survivingShare)),
    [1, "disposed", "disposed", "disposed", "disposed"],
  );
  assert.deepEqual(feedbackEvent(survivalFeedback(reports[1]!), "e-1", "unused"), {
    kind: "edit_survival",
    event_id: "e-1",
    session_id: "s-1",
    request_id: "r-1",
    occurred_at: new Date(T0 + 30_000).toISOString(),
    elapsed_s: 120,
    censored: true,
    surviving_share: null,
  });
  assert.deepEqual(feedbackEvent(survivalFeedback(reports[0]!), "e-0", "unused"), {
    kind: "edit_survival",
    event_id: "e-0",
    session_id: "s-1",
    request_id: "r-1",
    occurred_at: new Date(T0 + 30_000).toISOString(),
    elapsed_s: 30,
    surviving_share: 1,
  });
  assert.throws(() => tracker.trackAcceptedEdit(EDIT), /disposed/);
});

test("a renamed file, or a file in a renamed folder, is followed under its new name", (t) => {
  const { tracker, reports } = tracked(t);
  tracker.documentRenamed({ oldUri: "file:///work/app", newUri: "file:///work/lib" });
  const moved = "file:///work/lib/f.py";
  assert.ok(tracker.isTracking(moved));
  tracker.documentClosed(URI);
  tracker.documentChanged({ uri: URI, changes: [{ rangeOffset: 10, rangeLength: 17, text: "" }] });
  t.mock.timers.tick(30_000);
  assert.deepEqual(measured(reports[0]).documentUris, [moved]);
  assert.equal(measured(reports[0]).survivingShare, 1, "changes to the old name are not this document's");
  tracker.documentRenamed({ oldUri: moved, newUri: "file:///work/lib/g.py" });
  tracker.documentChanged({
    uri: "file:///work/lib/g.py",
    changes: [{ rangeOffset: 10, rangeLength: 17, text: "" }],
  });
  t.mock.timers.tick(90_000);
  assert.equal(measured(reports[1]).survivingShare, 0);
});

test("a deleted file's text counts as gone, flagged, and its closing censors nothing", (t) => {
  const { tracker, reports } = tracked(t);
  t.mock.timers.tick(30_000);
  tracker.documentDeleted("file:///work/app");
  tracker.documentClosed(URI);
  t.mock.timers.tick(90_000);
  const afterDeletion = measured(reports[1]);
  assert.equal(afterDeletion.survivingShare, 0);
  assert.deepEqual(afterDeletion.flags, { undoRedo: false, external: false, deleted: true });
  assert.deepEqual(measured(reports[0]).flags.deleted, false);
});

test("undo and redo that touch the AI's text are flagged, other history is not", (t) => {
  const { tracker, reports } = tracked(t);
  // An undo above the edit moves it and touches none of it.
  tracker.documentChanged({
    uri: URI,
    changes: [{ rangeOffset: 0, rangeLength: 0, text: "# x\n" }],
    reason: "undo",
  });
  t.mock.timers.tick(30_000);
  assert.equal(measured(reports[0]).flags.undoRedo, false);
  // Undoing the acceptance deletes the AI's line.
  tracker.documentChanged({
    uri: URI,
    changes: [{ rangeOffset: 14, rangeLength: 17, text: "" }],
    reason: "undo",
  });
  t.mock.timers.tick(90_000);
  const undone = measured(reports[1]);
  assert.deepEqual(undone.flags, { undoRedo: true, external: false, deleted: false });
  assert.equal(undone.survivingShare, 0);
  assert.equal(undone.scores.noRevert, 0);
});

test("a reload from disk is flagged; a whole-document replacement censors what is left", (t) => {
  const { tracker, reports } = tracked(t);
  tracker.documentChanged({
    uri: URI,
    changes: [{ rangeOffset: 14, rangeLength: 6, text: "yield" }],
    external: true,
    documentLength: 26,
  });
  t.mock.timers.tick(30_000);
  const reloaded = measured(reports[0]);
  assert.equal(reloaded.flags.external, true);
  assert.ok(reloaded.survivingShare < 1);
  // The whole text replaced: offset 0, and the new text is the whole document.
  tracker.documentChanged({
    uri: URI,
    changes: [{ rangeOffset: 0, rangeLength: 26, text: "print('rewritten')\n" }],
    documentLength: 19,
  });
  assert.deepEqual(
    reports.slice(1).map((r) => (r.censored ? [r.elapsedS, r.censoredBecause] : null)),
    [
      [120, "rewritten"],
      [300, "rewritten"],
      [600, "rewritten"],
      [900, "rewritten"],
    ],
  );
});

test("select-all and delete is a deletion, not a rewrite", (t) => {
  const { tracker, reports } = tracked(t);
  tracker.documentChanged({
    uri: URI,
    changes: [{ rangeOffset: 0, rangeLength: 27, text: "" }],
    documentLength: 0,
  });
  t.mock.timers.tick(30_000);
  assert.equal(measured(reports[0]).survivingShare, 0);
});

test("a request's hunks are one edit: one report per window, their grams pooled", (t) => {
  const { tracker, reports } = tracked(t);
  t.mock.timers.tick(10_000);
  tracker.trackAcceptedEdit({
    ...EDIT,
    documentUri: "file:///work/app/g.py",
    offset: 0,
    text: "import os\n",
  });
  // The second hunk (10 characters, 7 grams) is deleted; the first (14 grams) is untouched.
  tracker.documentChanged({
    uri: "file:///work/app/g.py",
    changes: [{ rangeOffset: 0, rangeLength: 10, text: "" }],
  });
  t.mock.timers.tick(20_000);
  assert.equal(reports.length, 1, "timed from the first acceptance");
  const pooled = measured(reports[0]);
  assert.equal(pooled.survivingShare, 14 / 21);
  assert.equal(pooled.scores.arc, 17);
  assert.equal(pooled.scores.arcShare, 17 / 27);
  assert.deepEqual(pooled.documentUris, [URI, "file:///work/app/g.py"]);
  tracker.documentClosed("file:///work/app/g.py");
  assert.ok(reports.slice(1).every((r) => r.censored));
});
