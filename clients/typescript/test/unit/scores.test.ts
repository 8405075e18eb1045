import assert from "node:assert/strict";
import { test } from "node:test";
import {
  fourGramSimilarity,
  levenshteinDistance,
  levenshteinPersistence,
  noRevertScore,
} from "../../src/index.js";

test("four-gram similarity on small strings", () => {
  assert.equal(fourGramSimilarity("return x + 3", "return x + 3"), 1);
  // 12 characters have 9 four-grams; changing the last one changes only the last gram
  // (" + 3" becomes " + 4"): 8 of 9 shared.
  assert.equal(fourGramSimilarity("return x + 3", "return x + 4"), 8 / 9);
  // "abcdef" has abcd, bcde, cdef; "abcxef" has abcx, bcxe, cxef: none shared.
  assert.equal(fourGramSimilarity("abcdef", "abcxef"), 0);
  // Grams count as a multiset: "aaaaa" has "aaaa" twice, "aaaa" once: 1 shared of 2.
  assert.equal(fourGramSimilarity("aaaaa", "aaaa"), 0.5);
  // Shorter than a gram: the whole text is one gram.
  assert.equal(fourGramSimilarity("ab", "ab"), 1);
  assert.equal(fourGramSimilarity("ab", "abc"), 0);
  assert.equal(fourGramSimilarity("", ""), 1);
  assert.equal(fourGramSimilarity("abcd", ""), 0);
});

test("Levenshtein distance and Cody's persistence", () => {
  // kitten -> sitten -> sittin -> sitting: two substitutions and an insertion.
  assert.equal(levenshteinDistance("kitten", "sitting"), 3);
  assert.equal(levenshteinPersistence("kitten", "sitting"), 1 - 3 / 7);
  // Around the common prefix and suffix: A -> B and one B inserted.
  assert.equal(levenshteinDistance("prefix-A-suffix", "prefix-BB-suffix"), 2);
  assert.equal(levenshteinPersistence("return x + 3", "return x + 4"), 1 - 1 / 12);
  assert.equal(levenshteinPersistence("", ""), 1);
  assert.equal(levenshteinPersistence("abc", ""), 0);
  // 11 x 10 differing characters are past a 50-cell budget: no answer rather than a stall.
  assert.equal(levenshteinDistance(`${"a".repeat(10)}x`, "b".repeat(10), 50), null);
});

test("no-revert is 1 while the edit stands and 0 once it is undone", () => {
  assert.equal(noRevertScore("let x = 1;", "let x = 2;", "let x = 2;"), 1);
  assert.equal(noRevertScore("let x = 1;", "let x = 2;", "let x = 1;"), 0);
  // An insertion is reverted by deleting it, not by editing it.
  assert.equal(noRevertScore("", "added()", ""), 0);
  assert.equal(noRevertScore("", "added()", "add"), 1);
  assert.equal(noRevertScore("same", "same", "anything"), 1);
  // replaced "abcdefgh" and the AI's "abcdWXYZ" share 1 of 5 grams (abcd): the edit went
  // 4/5 of the way. "abcdefYZ" shares 3 of 5 with the original (abcd bcde cdef): it is 2/5
  // away from it, half the edit's distance.
  assert.equal(noRevertScore("abcdefgh", "abcdWXYZ", "abcdefYZ"), 0.5);
});
