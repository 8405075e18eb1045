/**
 * How much of an AI edit survives, by the measures the two IDE assistants that measure it
 * use. Each is written from the published description of the measure, not from its code.
 */

const GRAM = 4;

/** The text's 4-grams with their counts; a text shorter than four characters is one gram. */
function fourGrams(text: string): Map<string, number> {
  const grams = new Map<string, number>();
  if (text.length === 0) return grams;
  if (text.length < GRAM) return grams.set(text, 1);
  for (let index = 0; index + GRAM <= text.length; index++) {
    const gram = text.slice(index, index + GRAM);
    grams.set(gram, (grams.get(gram) ?? 0) + 1);
  }
  return grams;
}

function gramCount(text: string): number {
  return text.length === 0 ? 0 : Math.max(1, text.length - GRAM + 1);
}

/** The 4-grams two texts share (as multisets) and the larger of their two gram counts. */
export function fourGramOverlap(a: string, b: string): { shared: number; total: number } {
  const gramsOfB = fourGrams(b);
  let shared = 0;
  for (const [gram, count] of fourGrams(a)) {
    shared += Math.min(count, gramsOfB.get(gram) ?? 0);
  }
  return { shared, total: Math.max(gramCount(a), gramCount(b)) };
}

/**
 * Copilot's four-gram similarity: the share of 4-grams the two texts have in common, out of
 * the larger text's. 1 for equal texts (two empty ones too), 0 when nothing is shared. Blind
 * to where in the span a kept piece went; linear in the texts' length.
 */
export function fourGramSimilarity(a: string, b: string): number {
  const { shared, total } = fourGramOverlap(a, b);
  return total === 0 ? 1 : shared / total;
}

/**
 * Copilot's no-revert score: how far the text is from going back to what the edit replaced,
 * as a share of how far the edit took it, by four-gram distance (1 − similarity). 1 while
 * the edit stands (or the text moved further away still), 0 once undone; 1 for an edit that
 * changed nothing.
 */
export function noRevertScore(replaced: string, ai: string, current: string): number {
  const editDistance = 1 - fourGramSimilarity(ai, replaced);
  if (editDistance === 0) return 1;
  return Math.min(1, (1 - fourGramSimilarity(current, replaced)) / editDistance);
}

/**
 * Cells of the edit-distance table computed at most (after the common prefix and suffix are
 * set aside): 16M, about 4,000 × 4,000 differing characters, some tens of milliseconds.
 */
export const LEVENSHTEIN_MAX_CELLS = 16_000_000;

/**
 * The Levenshtein distance (insertions, deletions and substitutions of UTF-16 code units),
 * or null when the differing middle of the two texts is past `maxCells`.
 */
export function levenshteinDistance(a: string, b: string, maxCells = LEVENSHTEIN_MAX_CELLS): number | null {
  let prefix = 0;
  while (prefix < a.length && prefix < b.length && a[prefix] === b[prefix]) prefix++;
  let suffix = 0;
  while (
    suffix < a.length - prefix &&
    suffix < b.length - prefix &&
    a[a.length - 1 - suffix] === b[b.length - 1 - suffix]
  ) {
    suffix++;
  }
  const left = a.slice(prefix, a.length - suffix);
  const right = b.slice(prefix, b.length - suffix);
  if (left.length === 0 || right.length === 0) return left.length + right.length;
  if (left.length * right.length > maxCells) return null;

  // One row of the table at a time: previous[j] is the distance of left[0, i) to right[0, j).
  let previous = Uint32Array.from({ length: right.length + 1 }, (_, j) => j);
  let current = new Uint32Array(right.length + 1);
  for (let i = 1; i <= left.length; i++) {
    current[0] = i;
    for (let j = 1; j <= right.length; j++) {
      const substitution = previous[j - 1]! + (left[i - 1] === right[j - 1] ? 0 : 1);
      current[j] = Math.min(substitution, previous[j]! + 1, current[j - 1]! + 1);
    }
    [previous, current] = [current, previous];
  }
  return previous[right.length]!;
}

/**
 * Cody's persistence: 1 − Levenshtein distance ÷ the longer text's length; 1 for two empty
 * texts, null when the texts are too large to compare (see `LEVENSHTEIN_MAX_CELLS`).
 */
export function levenshteinPersistence(ai: string, current: string): number | null {
  const longer = Math.max(ai.length, current.length);
  if (longer === 0) return 1;
  const distance = levenshteinDistance(ai, current);
  return distance === null ? null : 1 - distance / longer;
}
