import { randomUUID } from "node:crypto";
import { mkdir, readFile, rename, rm, writeFile } from "node:fs/promises";
import { dirname } from "node:path";

/** Where the feedback queue keeps its events between IDE runs: one JSON string. */
export interface FeedbackStorage {
  get(): Promise<string | undefined>;
  set(value: string): Promise<void>;
}

/** Kept in memory only: for tests, and for hosts that persist nothing. */
export class MemoryStorage implements FeedbackStorage {
  constructor(public value: string | undefined = undefined) {}

  async get(): Promise<string | undefined> {
    return this.value;
  }

  async set(value: string): Promise<void> {
    this.value = value;
  }
}

/**
 * One file; each write goes to a temporary file renamed over it, so a crash leaves the old
 * queue or the new one, never half of one.
 */
export class FileStorage implements FeedbackStorage {
  constructor(readonly path: string) {}

  async get(): Promise<string | undefined> {
    try {
      return await readFile(this.path, "utf8");
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === "ENOENT") return undefined;
      throw error;
    }
  }

  async set(value: string): Promise<void> {
    await mkdir(dirname(this.path), { recursive: true });
    const temporary = `${this.path}.${randomUUID()}.tmp`;
    try {
      await writeFile(temporary, value, { encoding: "utf8", flush: true });
      await rename(temporary, this.path);
    } catch (error) {
      await rm(temporary, { force: true });
      throw error;
    }
  }
}
