/**
 * One replacement in a document: `rangeLength` UTF-16 code units at `rangeOffset` replaced by
 * `text`. The changes of one event all use offsets of the document before the event, as VS
 * Code's `contentChanges` do.
 */
export interface TextChange {
  rangeOffset: number;
  rangeLength: number;
  text: string;
}

/**
 * One event's changes in the order they can be applied one after another: from the end of
 * the document backwards, so that no change moves the offsets of those still to apply.
 * (VS Code already sends them so; the sort is stable and then changes nothing.)
 */
export function inApplyOrder(changes: readonly TextChange[]): TextChange[] {
  return [...changes].sort((a, b) => b.rangeOffset - a.rangeOffset);
}

/**
 * Where an accepted edit's text is in its document now, and what that span says.
 *
 * The span is followed through every change without the document's text: a change before it
 * moves it, a change inside it (or straddling an end) rewrites it, a change after it does
 * nothing. Text typed right at either end is outside the span: it was not the AI's.
 */
export class TrackedRegion {
  start: number;
  end: number;
  /** The span's current text. */
  text: string;
  /** The AI's characters that no change has touched, as [start, end) document offsets. */
  private unchanged: Array<[number, number]>;

  constructor(
    offset: number,
    readonly aiText: string,
    /** What the edit replaced ("" for an insertion): what undoing it would bring back. */
    readonly replacedText = "",
  ) {
    this.start = offset;
    this.end = offset + aiText.length;
    this.text = aiText;
    this.unchanged = aiText.length > 0 ? [[this.start, this.end]] : [];
  }

  /** How many of the AI's characters are still there, untouched (ARC). */
  get unchangedChars(): number {
    return this.unchanged.reduce((sum, [start, end]) => sum + end - start, 0);
  }

  /** Maps the region through one change; true when the change touched the region's text. */
  apply(change: TextChange): boolean {
    const { rangeOffset: from, rangeLength: length, text } = change;
    const to = from + length;
    const delta = text.length - length;
    this.unchanged = this.unchanged.flatMap(([start, end]): Array<[number, number]> => {
      if (end <= from) return [[start, end]];
      if (start >= to) return [[start + delta, end + delta]];
      const pieces: Array<[number, number]> = [];
      if (start < from) pieces.push([start, from]);
      if (end > to) pieces.push([to + delta, end + delta]);
      return pieces;
    });
    const overlaps = from < this.end && to > this.start;
    const insertsInside = length === 0 && from > this.start && from < this.end;
    if (overlaps || insertsInside) {
      const head = this.text.slice(0, Math.max(0, from - this.start));
      const tail = this.text.slice(Math.min(this.text.length, to - this.start));
      this.start = Math.min(this.start, from);
      this.text = head + text + tail;
      this.end = this.start + this.text.length;
      return true;
    }
    if (to <= this.start) {
      this.start += delta;
      this.end += delta;
    }
    return false;
  }

  /** The file is gone, and the AI's text with it. */
  deleteAll(): void {
    this.text = "";
    this.end = this.start;
    this.unchanged = [];
  }
}
