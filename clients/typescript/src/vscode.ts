import * as vscode from "vscode";
import {
  type ChatRequestOptions,
  type ServedRequest,
  chatHeaders,
  newSessionId,
  servedRequest,
} from "./headers.js";
import type { FeedbackEvent } from "./events.js";
import { type DropReason, FeedbackQueue } from "./queue.js";
import type { FeedbackStorage } from "./storage.js";
import { EditSurvivalTracker, type SurvivalReport, survivalFeedback } from "./survival/tracker.js";

/** The queue in `ExtensionContext.globalState` (kept across reloads and restarts). */
export class GlobalStateStorage implements FeedbackStorage {
  constructor(
    private readonly state: vscode.Memento,
    private readonly key: string,
  ) {}

  async get(): Promise<string | undefined> {
    return this.state.get<string>(this.key);
  }

  async set(value: string): Promise<void> {
    await this.state.update(this.key, value);
  }
}

export interface RtrlFeedbackOptions {
  gatewayUrl: string;
  apiKey: string;
  /** The user's stable id; the gateway uses the key's id when absent. */
  userId?: string;
  privacy?: boolean;
  /** Every survival report, with all its scores (the gateway gets the four-gram score only). */
  onReport?: (report: SurvivalReport) => void;
  /** Events the gateway refused for good, or that the queue's cap pushed out. */
  onDropped?: (events: readonly FeedbackEvent[], reason: DropReason) => void;
  onError?: (error: unknown) => void;
  /** Default: globalState, under a key of this workspace's, so that two windows never share a queue. */
  storage?: FeedbackStorage;
  flushIntervalMs?: number;
}

/**
 * rtrl feedback for one VS Code window: its session id and request headers, the feedback
 * queue, and the survival of accepted edits followed through the editor's events.
 * Have the extension's `deactivate` return `close()`.
 */
export class RtrlFeedback implements vscode.Disposable {
  readonly sessionId = newSessionId("vscode");
  private readonly tracker: EditSurvivalTracker;
  private readonly listeners: vscode.Disposable[] = [];
  /** Files being renamed or deleted: their documents close, but their text is still followed. */
  private readonly leaving = new Set<string>();
  private readonly acceptedRequests = new Set<string>();
  private lastRequestId: string | null = null;

  private constructor(
    private readonly options: RtrlFeedbackOptions,
    private readonly queue: FeedbackQueue,
  ) {
    this.tracker = new EditSurvivalTracker({
      onReport: (report) => {
        options.onReport?.(report);
        this.queue.enqueue(survivalFeedback(report)).catch((error: unknown) => options.onError?.(error));
      },
    });
    this.listen();
  }

  static async activate(
    context: vscode.ExtensionContext,
    options: RtrlFeedbackOptions,
  ): Promise<RtrlFeedback> {
    const queue = await FeedbackQueue.open({
      gatewayUrl: options.gatewayUrl,
      apiKey: options.apiKey,
      privacy: options.privacy ?? false,
      storage:
        options.storage ??
        new GlobalStateStorage(context.globalState, `rtrl.feedbackQueue:${workspaceKey()}`),
      ...(options.flushIntervalMs === undefined ? {} : { flushIntervalMs: options.flushIntervalMs }),
      ...(options.onDropped === undefined ? {} : { onDropped: options.onDropped }),
      ...(options.onError === undefined ? {} : { onStorageError: options.onError }),
    });
    const feedback = new RtrlFeedback(options, queue);
    context.subscriptions.push(feedback);
    return feedback;
  }

  /** The headers of a chat request in this window's session. */
  chatHeaders(
    request: Pick<ChatRequestOptions, "requestId" | "editRequest" | "parentRequestId"> = {},
  ): Record<string, string> {
    return chatHeaders({
      ...request,
      apiKey: this.options.apiKey,
      sessionId: this.sessionId,
      ...(this.options.userId === undefined ? {} : { userId: this.options.userId }),
      privacy: this.options.privacy ?? false,
    });
  }

  /** The ids a chat response was served under; remembers the last one for the session's end. */
  served(response: { headers: { get(name: string): string | null } }): ServedRequest {
    const served = servedRequest(response);
    this.lastRequestId = served.requestId;
    return served;
  }

  /** The user kept the AI's text now at `range` (call once it is applied); a request's other hunks may follow. */
  async editAccepted(
    requestId: string,
    document: vscode.TextDocument,
    range: vscode.Range,
    replacedText = "",
  ): Promise<void> {
    this.tracker.trackAcceptedEdit({
      requestId,
      sessionId: this.sessionId,
      documentUri: document.uri.toString(),
      offset: document.offsetAt(range.start),
      text: document.getText(range),
      replacedText,
    });
    if (!this.acceptedRequests.has(requestId)) {
      this.acceptedRequests.add(requestId);
      await this.queue.enqueue({ kind: "edit_accepted", session_id: this.sessionId, request_id: requestId });
    }
  }

  async editRejected(requestId: string): Promise<void> {
    await this.queue.enqueue({ kind: "edit_rejected", session_id: this.sessionId, request_id: requestId });
  }

  /** The user's next message after the completion `requestId`. */
  async followup(requestId: string, message: string): Promise<void> {
    await this.queue.enqueue({
      kind: "followup_message",
      session_id: this.sessionId,
      request_id: requestId,
      message,
    });
  }

  flush(): ReturnType<FeedbackQueue["flush"]> {
    return this.queue.flush();
  }

  /** The window is closing: censor what is still followed, end the session, send what can be sent. */
  async close(): Promise<void> {
    this.dispose();
    if (this.lastRequestId !== null) {
      await this.queue
        .enqueue({ kind: "session_end", session_id: this.sessionId, request_id: this.lastRequestId })
        .catch((error: unknown) => this.options.onError?.(error));
      this.lastRequestId = null;
    }
    await this.queue.flush().catch((error: unknown) => this.options.onError?.(error));
    await this.queue.close();
  }

  dispose(): void {
    for (const listener of this.listeners.splice(0)) listener.dispose();
    this.tracker.dispose();
  }

  private listen(): void {
    const { workspace } = vscode;
    this.listeners.push(
      workspace.onDidChangeTextDocument((event) => {
        const uri = event.document.uri.toString();
        if (event.contentChanges.length === 0 || !this.tracker.isTracking(uri)) return;
        const { document } = event;
        this.tracker.documentChanged({
          uri,
          changes: event.contentChanges.map(({ rangeOffset, rangeLength, text }) => ({
            rangeOffset,
            rangeLength,
            text,
          })),
          reason: historyReason(event.reason),
          // Typing leaves a document dirty; a reload from disk leaves it clean.
          external: event.reason === undefined && !document.isDirty,
          documentLength: document.offsetAt(document.lineAt(document.lineCount - 1).range.end),
        });
      }),
      workspace.onWillRenameFiles((event) =>
        event.files.forEach((file) => this.leaving.add(file.oldUri.toString())),
      ),
      workspace.onWillDeleteFiles((event) =>
        event.files.forEach((file) => this.leaving.add(file.toString())),
      ),
      workspace.onDidRenameFiles((event) => {
        for (const file of event.files) {
          this.tracker.documentRenamed({ oldUri: file.oldUri.toString(), newUri: file.newUri.toString() });
          this.leaving.delete(file.oldUri.toString());
        }
      }),
      workspace.onDidDeleteFiles((event) => {
        for (const file of event.files) {
          this.tracker.documentDeleted(file.toString());
          this.leaving.delete(file.toString());
        }
      }),
      workspace.onDidCloseTextDocument((document) => {
        const uri = document.uri.toString();
        if (![...this.leaving].some((from) => uri === from || uri.startsWith(`${from}/`))) {
          this.tracker.documentClosed(uri);
        }
      }),
    );
  }
}

function historyReason(reason: vscode.TextDocumentChangeReason | undefined): "undo" | "redo" | undefined {
  if (reason === vscode.TextDocumentChangeReason.Undo) return "undo";
  if (reason === vscode.TextDocumentChangeReason.Redo) return "redo";
  return undefined;
}

/** This window's workspace (its file, else its first folder), or "empty". */
function workspaceKey(): string {
  const workspace = vscode.workspace.workspaceFile ?? vscode.workspace.workspaceFolders?.[0]?.uri;
  return workspace?.toString() ?? "empty";
}
