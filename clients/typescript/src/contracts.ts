/**
 * The contracts of TanStack AI's sandbox layer (`@tanstack/ai-sandbox` 0.5.1) that casfs
 * implements: a sandbox provider and its handles, the portable checkpoint store and its
 * writer leases, and the sandbox instance store. TypeScript types are structural, so
 * casfs's provider and stores are what the framework's `SandboxProvider`,
 * `SandboxCheckpointStore` and `SandboxInstanceStore` name, and plug into `withSandbox`
 * and `defineSandbox` as they are. They are declared here (not imported) because that
 * version of the framework is not on the npm registry; `docs/middleware.md` says how
 * they were checked against it.
 */

/** What a provider's sandboxes can do. */
export interface SandboxCapabilities {
  fs: boolean
  exec: boolean
  env: boolean
  ports: boolean
  /** `process.spawn` runs a process in the background. */
  backgroundProcesses: boolean
  /** A spawned process's stdin can be written. */
  writableStdin: boolean
  /** `kill` and an aborted `signal` end a process and everything it started. */
  killableProcesses: boolean
  /** `handle.snapshot` and `provider.restoreSnapshot`. */
  snapshots: boolean
  networkPolicy: boolean
  /** The workspace outlives the host process that made it (a resume finds it). */
  durableFilesystem: boolean
  /** `handle.fork`. */
  fork: boolean
}

export interface ExecResult {
  stdout: string
  stderr: string
  exitCode: number
}

export interface ProcessOptions {
  /** Default: the workspace root. */
  cwd?: string
  /** Merged over the sandbox's environment. */
  env?: Record<string, string>
  signal?: AbortSignal
}

export interface SpawnHandle {
  readonly pid: number
  readonly stdout: AsyncIterable<string>
  readonly stderr: AsyncIterable<string>
  readonly stdin: { write: (data: string) => Promise<void>; end: () => Promise<void> }
  /** The exit code. */
  wait: () => Promise<number>
  kill: (signal?: NodeJS.Signals | number) => Promise<void>
}

export interface SandboxProcess {
  exec: (command: string, options?: ProcessOptions) => Promise<ExecResult>
  spawn: (command: string, options?: ProcessOptions) => Promise<SpawnHandle>
}

/** `mode` is the whole POSIX mode, file-type bits included. */
export type SandboxFsStat =
  | { type: 'file'; mode: number; size: number }
  | { type: 'dir'; mode: number }
  | { type: 'symlink'; mode: number }
  | { type: 'other'; mode: number }

export interface SandboxFs {
  read: (path: string) => Promise<string>
  readBytes: (path: string) => Promise<Uint8Array>
  write: (path: string, data: string | Uint8Array) => Promise<void>
  list: (path: string) => Promise<Array<{ name: string; path: string; type: 'file' | 'dir' }>>
  mkdir: (path: string) => Promise<void>
  remove: (path: string) => Promise<void>
  rename: (from: string, to: string) => Promise<void>
  exists: (path: string) => Promise<boolean>
  /** Never follows a symlink; undefined only for a path that does not exist. */
  lstat?: (path: string) => Promise<SandboxFsStat | undefined>
  watch?: (
    path: string,
    onEvent: (event: { type: string; path: string }) => void,
  ) => Promise<{ stop: () => Promise<void> }>
}

export interface SandboxGit {
  clone: (input: {
    url: string
    dir?: string
    ref?: string
    auth?: { username?: string; token: string }
    depth?: number | 'full'
  }) => Promise<void>
  status: (dir?: string) => Promise<string>
  add: (paths: Array<string>, dir?: string) => Promise<void>
  commit: (message: string, dir?: string) => Promise<void>
  push: (dir?: string) => Promise<void>
  pull: (dir?: string) => Promise<void>
  /** The current branch's name. */
  branch: (dir?: string) => Promise<string>
}

export interface SandboxChannel {
  url: string
  token?: string
  headers?: Record<string, string>
}

export interface SandboxPorts {
  connect: (port: number) => Promise<SandboxChannel>
}

export interface SandboxEnv {
  set: (vars: Record<string, string>) => Promise<void>
}

export interface SnapshotRef {
  id: string
  label?: string
}

export interface SandboxHandle {
  readonly id: string
  readonly provider: string
  /** The real directory behind the virtual `/workspace`. */
  readonly workspaceRoot?: string
  readonly capabilities: SandboxCapabilities
  readonly fs: SandboxFs
  readonly git: SandboxGit
  readonly process: SandboxProcess
  readonly ports: SandboxPorts
  readonly env: SandboxEnv
  snapshot?: (label?: string) => Promise<SnapshotRef>
  fork?: () => Promise<SandboxHandle>
  destroy: () => Promise<void>
}

export interface SandboxCreateInput {
  /** The framework's sandbox key (kept in the name of casfs's thread). */
  id?: string
  /** The framework bootstraps the workspace itself through the handle. */
  workspace?: unknown
  policy?: unknown
  env?: Record<string, string>
  signal?: AbortSignal
  adapterName?: string
}

export interface SandboxResumeInput {
  id: string
  signal?: AbortSignal
}

export interface SandboxRestoreInput {
  snapshotId: string
  workspace?: unknown
  policy?: unknown
  env?: Record<string, string>
  signal?: AbortSignal
}

export interface SandboxDestroyInput {
  id: string
  signal?: AbortSignal
}

export interface SandboxProvider {
  readonly name: string
  capabilities: () => SandboxCapabilities
  create: (input: SandboxCreateInput) => Promise<SandboxHandle>
  /** The live sandbox of this id, or null if it is gone. */
  resume: (input: SandboxResumeInput) => Promise<SandboxHandle | null>
  restoreSnapshot?: (input: SandboxRestoreInput) => Promise<SandboxHandle>
  destroy: (input: SandboxDestroyInput) => Promise<void>
}

export interface SandboxSnapshotFileEntry {
  path: string
  kind: 'file'
  blobKey: string
  size: number
}

export interface SandboxSnapshotDirectoryEntry {
  path: string
  kind: 'dir'
}

export type SandboxSnapshotEntry = SandboxSnapshotFileEntry | SandboxSnapshotDirectoryEntry

export interface SandboxSnapshotArtifact {
  artifactId: string
  name: string
  mimeType: string
  size: number
  blobKey: string
  createdAt: number
}

/** A message of the conversation: `@tanstack/ai`'s own type (a type-only import). */
export type { ModelMessage } from '@tanstack/ai'
import type { ModelMessage } from '@tanstack/ai'

export interface SandboxCheckpoint {
  id: string
  threadId: string
  parentCheckpointId: string | null
  createdAt: number
  reason: 'automatic' | 'named' | 'fork-root'
  label?: string
  sourceRunId?: string
  files: ReadonlyArray<SandboxSnapshotEntry>
  conversation: ReadonlyArray<ModelMessage>
  artifacts: ReadonlyArray<SandboxSnapshotArtifact>
}

export interface SandboxCheckpointWriter {
  threadId: string
  ownerToken: string
  fence: number
}

export interface SandboxCheckpointWriterLease extends SandboxCheckpointWriter {
  expiresAt: number
  renewAfterMs: number
  renew: () => Promise<{ expiresAt: number }>
  release: () => Promise<void>
}

export interface SandboxCheckpointForkInput {
  sourceThreadId: string
  sourceCheckpointId: string
  destinationThreadId: string
  destinationCheckpointId: string
  createdAt: number
  writer: SandboxCheckpointWriter
}

export interface SandboxCheckpointStore {
  get: (id: string) => Promise<SandboxCheckpoint | null>
  list: (threadId: string) => Promise<Array<SandboxCheckpoint>>
  getHead: (threadId: string) => Promise<string | null>
  append: (input: {
    checkpoint: SandboxCheckpoint
    expectedHeadId: string | null
    writer: SandboxCheckpointWriter
  }) => Promise<{ headId: string }>
  deleteHead: (input: {
    threadId: string
    checkpointId: string
    writer: SandboxCheckpointWriter
  }) => Promise<void>
  acquireWriter: (threadId: string) => Promise<SandboxCheckpointWriterLease>
  listBlobReferences: () => Promise<Array<{ key: string; references: number }>>
  forkFromCheckpoint?: (
    input: SandboxCheckpointForkInput,
  ) => Promise<{ checkpoint: SandboxCheckpoint }>
}

export interface SandboxCheckpointStoreOptions {
  now?: () => number
  leaseDurationMs?: number
  renewAfterMs?: number
}

export interface SandboxInstanceRecord {
  key: string
  provider: string
  providerSandboxId: string
  latestSnapshotId?: string
  threadId: string
  latestRunId?: string
  updatedAt: number
}

export interface SandboxInstanceStore {
  /** null for a key with no record. */
  get: (key: string) => Promise<SandboxInstanceRecord | null>
  /** Replaces the record whole: optional fields left out are gone. */
  upsert: (record: SandboxInstanceRecord) => Promise<void>
  /** A key with no record: nothing happens. */
  delete: (key: string) => Promise<void>
}

/** A thread's transcript, as the framework's message store keeps it. */
export interface MessageStore {
  loadThread: (threadId: string) => Promise<Array<ModelMessage>>
  saveThread: (threadId: string, messages: Array<ModelMessage>) => Promise<void>
}
