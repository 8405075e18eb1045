import { type Clock, systemClock } from "../clock.js";
import type { FeedbackEventInput } from "../events.js";
import { isValidId } from "../headers.js";
import { type TextChange, TrackedRegion, inApplyOrder } from "./regions.js";
import { fourGramOverlap, levenshteinDistance, noRevertScore } from "./scores.js";

/** When an accepted edit's survival is measured, in seconds after acceptance (Copilot's windows past 5 s). */
export const SURVIVAL_WINDOWS_S: readonly number[] = [30, 120, 300, 600, 900];

/** An AI edit the user accepted, as it is in the document now (call once it is applied). */
export interface AcceptedEdit {
  requestId: string;
  sessionId: string;
  documentUri: string;
  /** Where the AI's text starts, in UTF-16 code units (VS Code's `document.offsetAt`). */
  offset: number;
  /** The AI's text. */
  text: string;
  /** What the edit replaced; "" (the default) for an insertion. */
  replacedText?: string;
}

/** One `onDidChangeTextDocument`, in editor-independent terms. */
export interface DocumentChangeEvent {
  uri: string;
  /** All with offsets of the document before the event. */
  changes: readonly TextChange[];
  /** The change replays the editor's history. */
  reason?: "undo" | "redo";
  /** The change came from outside the editor: the file changed on disk and was reloaded. */
  external?: boolean;
  /** The document's length after the change, to recognise a whole-document replacement. */
  documentLength?: number;
}

export interface SurvivalScores {
  /** Copilot: four-gram similarity of the AI's text and what its span says now. Sent as `surviving_share`. */
  fourGram: number;
  /** Copilot: 1 while the edit stands, 0 once what it replaced is back. */
  noRevert: number;
  /** Copilot's ARC: the AI's characters still there untouched. A count, not a share. */
  arc: number;
  /** ARC over the AI's characters. */
  arcShare: number;
  /** Cody: 1 − Levenshtein distance ÷ the longer text; null when the texts are too large to compare. */
  levenshtein: number | null;
}

/** What else happened to the AI's text, so that a report can be read apart from the others. */
export interface SurvivalFlags {
  /** An undo or redo touched the AI's text. */
  undoRedo: boolean;
  /** A reload from disk touched the AI's text. */
  external: boolean;
  /** A document that held the AI's text was deleted; its text counts as gone. */
  deleted: boolean;
}

/**
 * Why windows went unobserved: the document closed, the tracker was disposed (the IDE is
 * closing), or the whole document was replaced so the AI's text could no longer be followed.
 */
export type CensorReason = "closed" | "disposed" | "rewritten";

interface ReportFields {
  requestId: string;
  sessionId: string;
  /** Where the AI's text is now. */
  documentUris: string[];
  /** The window, in seconds after acceptance. */
  elapsedS: number;
  /** When the report was made, in milliseconds since the epoch. */
  measuredAt: number;
  flags: SurvivalFlags;
}

/** One window of one accepted edit: measured, or censored (missing, never 0). */
export type SurvivalReport =
  | (ReportFields & { censored: false; survivingShare: number; scores: SurvivalScores })
  | (ReportFields & { censored: true; censoredBecause: CensorReason });

export interface EditSurvivalTrackerOptions {
  /** Called once for every window of every tracked edit. */
  onReport: (report: SurvivalReport) => void;
  clock?: Clock;
  /** Default `SURVIVAL_WINDOWS_S`. */
  windowsS?: readonly number[];
}

interface Placement {
  uri: string;
  region: TrackedRegion;
  deleted: boolean;
}

interface TrackedEdit {
  requestId: string;
  sessionId: string;
  acceptedAt: number;
  placements: Placement[];
  nextWindow: number;
  timer: unknown;
  flags: SurvivalFlags;
}

/**
 * Follows accepted AI edits through every later change of their documents and reports, at
 * each window, how much of each survives. The edits of one request (several hunks, several
 * files) are one tracked edit with one report per window, timed from the first acceptance.
 */
export class EditSurvivalTracker {
  private readonly clock: Clock;
  private readonly windowsS: readonly number[];
  private readonly edits = new Map<string, TrackedEdit>();
  private disposed = false;

  constructor(private readonly options: EditSurvivalTrackerOptions) {
    this.clock = options.clock ?? systemClock;
    this.windowsS = options.windowsS ?? SURVIVAL_WINDOWS_S;
  }

  /** Starts following an accepted edit; another edit of a request still followed joins it. */
  trackAcceptedEdit(accepted: AcceptedEdit): void {
    if (this.disposed) throw new Error("The edit survival tracker is disposed");
    if (!isValidId(accepted.requestId) || !isValidId(accepted.sessionId)) {
      throw new RangeError("requestId and sessionId must be ids the gateway accepts");
    }
    if (!Number.isInteger(accepted.offset) || accepted.offset < 0) {
      throw new RangeError(`offset must be a non-negative integer, not ${accepted.offset}`);
    }
    const placement: Placement = {
      uri: accepted.documentUri,
      region: new TrackedRegion(accepted.offset, accepted.text, accepted.replacedText),
      deleted: false,
    };
    const followed = this.edits.get(accepted.requestId);
    if (followed !== undefined) {
      followed.placements.push(placement);
      return;
    }
    const edit: TrackedEdit = {
      requestId: accepted.requestId,
      sessionId: accepted.sessionId,
      acceptedAt: this.clock.now(),
      placements: [placement],
      nextWindow: 0,
      timer: null,
      flags: { undoRedo: false, external: false, deleted: false },
    };
    this.edits.set(edit.requestId, edit);
    this.scheduleWindow(edit);
  }

  /** Whether an edit is followed in this document (to skip the others' changes cheaply). */
  isTracking(uri: string): boolean {
    return [...this.edits.values()].some((edit) => edit.placements.some((p) => p.uri === uri && !p.deleted));
  }

  /** Where a followed request's AI text is now, and what it says. */
  regionsOf(requestId: string): Array<{ documentUri: string; start: number; end: number; text: string }> {
    const edit = this.edits.get(requestId);
    return (edit?.placements ?? []).map(({ uri, region }) => ({
      documentUri: uri,
      start: region.start,
      end: region.end,
      text: region.text,
    }));
  }

  documentChanged(event: DocumentChangeEvent): void {
    if (event.changes.length === 0) return;
    const [only] = event.changes;
    // A replacement of everything by new text says nothing of where the AI's text went.
    const rewritten =
      event.changes.length === 1 &&
      only !== undefined &&
      only.rangeOffset === 0 &&
      only.rangeLength > 0 &&
      only.text.length > 0 &&
      only.text.length === event.documentLength;
    const changes = inApplyOrder(event.changes);
    for (const edit of this.editsIn(event.uri)) {
      if (rewritten) {
        this.censor(edit, "rewritten");
        continue;
      }
      for (const placement of edit.placements) {
        if (placement.uri !== event.uri || placement.deleted) continue;
        let touched = false;
        for (const change of changes) touched = placement.region.apply(change) || touched;
        if (touched && event.reason !== undefined) edit.flags.undoRedo = true;
        if (touched && event.external) edit.flags.external = true;
      }
    }
  }

  /** A file or folder was renamed or moved. */
  documentRenamed(rename: { oldUri: string; newUri: string }): void {
    for (const edit of this.edits.values()) {
      for (const placement of edit.placements) {
        const moved = movedUri(placement.uri, rename.oldUri, rename.newUri);
        if (moved !== null) placement.uri = moved;
      }
    }
  }

  /** A file or folder was deleted: the AI's text in it is gone (survival 0, flagged `deleted`). */
  documentDeleted(uri: string): void {
    for (const edit of this.edits.values()) {
      for (const placement of edit.placements) {
        if (!placement.deleted && movedUri(placement.uri, uri, uri) !== null) {
          placement.region.deleteAll();
          placement.deleted = true;
          edit.flags.deleted = true;
        }
      }
    }
  }

  /** The document can no longer be followed: its edits' remaining windows are censored now. */
  documentClosed(uri: string): void {
    for (const edit of this.editsIn(uri)) this.censor(edit, "closed");
  }

  /** The IDE is closing: every remaining window of every edit is censored now. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    for (const edit of [...this.edits.values()]) this.censor(edit, "disposed");
  }

  private editsIn(uri: string): TrackedEdit[] {
    return [...this.edits.values()].filter((edit) =>
      edit.placements.some((placement) => placement.uri === uri && !placement.deleted),
    );
  }

  private scheduleWindow(edit: TrackedEdit): void {
    const windowS = this.windowsS[edit.nextWindow];
    if (windowS === undefined) {
      this.edits.delete(edit.requestId);
      return;
    }
    const delayMs = Math.max(0, edit.acceptedAt + windowS * 1000 - this.clock.now());
    edit.timer = this.clock.setTimeout(() => {
      edit.timer = null;
      edit.nextWindow += 1;
      this.options.onReport({
        ...this.reportFields(edit, windowS),
        censored: false,
        ...measure(edit.placements),
      });
      this.scheduleWindow(edit);
    }, delayMs);
  }

  private censor(edit: TrackedEdit, reason: CensorReason): void {
    if (edit.timer !== null) this.clock.clearTimeout(edit.timer);
    this.edits.delete(edit.requestId);
    for (const windowS of this.windowsS.slice(edit.nextWindow)) {
      this.options.onReport({ ...this.reportFields(edit, windowS), censored: true, censoredBecause: reason });
    }
  }

  private reportFields(edit: TrackedEdit, elapsedS: number): ReportFields {
    return {
      requestId: edit.requestId,
      sessionId: edit.sessionId,
      documentUris: [...new Set(edit.placements.map((placement) => placement.uri))],
      elapsedS,
      measuredAt: this.clock.now(),
      flags: { ...edit.flags },
    };
  }
}

/** The scores of all of a request's regions together, each weighted by its size. */
function measure(placements: readonly Placement[]): { survivingShare: number; scores: SurvivalScores } {
  let sharedGrams = 0;
  let totalGrams = 0;
  let noRevertWeighted = 0;
  let aiChars = 0;
  let arc = 0;
  let distance: number | null = 0;
  let longer = 0;
  for (const { region } of placements) {
    const overlap = fourGramOverlap(region.aiText, region.text);
    sharedGrams += overlap.shared;
    totalGrams += overlap.total;
    noRevertWeighted +=
      noRevertScore(region.replacedText, region.aiText, region.text) * Math.max(1, region.aiText.length);
    aiChars += region.aiText.length;
    arc += region.unchangedChars;
    const regionDistance = levenshteinDistance(region.aiText, region.text);
    distance = distance === null || regionDistance === null ? null : distance + regionDistance;
    longer += Math.max(region.aiText.length, region.text.length);
  }
  const weights = placements.reduce((sum, { region }) => sum + Math.max(1, region.aiText.length), 0);
  const fourGram = totalGrams === 0 ? 1 : sharedGrams / totalGrams;
  const scores: SurvivalScores = {
    fourGram,
    noRevert: noRevertWeighted / weights,
    arc,
    arcShare: aiChars === 0 ? 1 : arc / aiChars,
    levenshtein: distance === null ? null : longer === 0 ? 1 : 1 - distance / longer,
  };
  return { survivingShare: fourGram, scores };
}

/** `uri` once `from` (the file itself, or a folder above it) became `to`; null when not under `from`. */
function movedUri(uri: string, from: string, to: string): string | null {
  if (uri === from) return to;
  const folder = from.endsWith("/") ? from : `${from}/`;
  return uri.startsWith(folder) ? `${to.replace(/\/$/, "")}/${uri.slice(folder.length)}` : null;
}

/** The `edit_survival` event a report is sent as: its four-gram score, or censored. */
export function survivalFeedback(report: SurvivalReport): FeedbackEventInput {
  const ids = {
    session_id: report.sessionId,
    request_id: report.requestId,
    occurred_at: new Date(report.measuredAt).toISOString(),
  };
  if (report.censored) {
    return {
      kind: "edit_survival",
      ...ids,
      elapsed_s: report.elapsedS,
      censored: true,
      surviving_share: null,
    };
  }
  return {
    kind: "edit_survival",
    ...ids,
    elapsed_s: report.elapsedS,
    surviving_share: report.survivingShare,
  };
}
