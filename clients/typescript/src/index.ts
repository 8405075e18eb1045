export { type Clock, systemClock } from "./clock.js";
export {
  type ChatRequestOptions,
  type ServedRequest,
  chatHeaders,
  isValidId,
  newRequestId,
  newSessionId,
  servedRequest,
} from "./headers.js";
export {
  type FeedbackEvent,
  type FeedbackEventInput,
  MAX_ELAPSED_S,
  MAX_FOLLOWUP_CHARS,
  feedbackEvent,
} from "./events.js";
export { type FeedbackStorage, FileStorage, MemoryStorage } from "./storage.js";
export {
  type DropReason,
  type FeedbackAnswer,
  type FeedbackQueueOptions,
  type FlushOutcome,
  FeedbackQueue,
  MAX_BATCH,
  retryAfterMs,
} from "./queue.js";
export { type TextChange, TrackedRegion, inApplyOrder } from "./survival/regions.js";
export {
  LEVENSHTEIN_MAX_CELLS,
  fourGramOverlap,
  fourGramSimilarity,
  levenshteinDistance,
  levenshteinPersistence,
  noRevertScore,
} from "./survival/scores.js";
export {
  type AcceptedEdit,
  type CensorReason,
  type DocumentChangeEvent,
  type EditSurvivalTrackerOptions,
  type SurvivalFlags,
  type SurvivalReport,
  type SurvivalScores,
  EditSurvivalTracker,
  SURVIVAL_WINDOWS_S,
  survivalFeedback,
} from "./survival/tracker.js";
