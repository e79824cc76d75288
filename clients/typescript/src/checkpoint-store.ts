/**
 * casfs as the framework's portable checkpoint store (`SandboxCheckpointStore`, with the
 * fork capability), its transcript store for forks, and its sandbox instance store
 * (`SandboxInstanceStore`): each a named store of `casfs serve` (`/v1/stores/{store}`),
 * durable in casfs's store (RocksDB, or PostgreSQL on a fleet). The server checks the
 * writer (owner secret and fence), the head's compare-and-swap and the framework's
 * rules in one atomic step, in the framework's order; this client checks first only
 * what JSON cannot carry (a lone UTF-16 surrogate, a non-finite number).
 */
import type { CasfsClient } from './client.js'
import type {
  MessageStore,
  ModelMessage,
  SandboxCheckpoint,
  SandboxCheckpointForkInput,
  SandboxCheckpointStore,
  SandboxCheckpointStoreOptions,
  SandboxCheckpointWriter,
  SandboxCheckpointWriterLease,
  SandboxInstanceRecord,
  SandboxInstanceStore,
} from './contracts.js'
import {
  asCheckpointError,
  SandboxCheckpointInvalidEntryError,
  SandboxCheckpointInvalidIdError,
  SandboxCheckpointWriterLostError,
} from './errors.js'

function hasUnpairedSurrogate(value: string): boolean {
  for (let i = 0; i < value.length; i++) {
    const c = value.charCodeAt(i)
    if (c >= 0xd800 && c <= 0xdbff) {
      const next = value.charCodeAt(i + 1)
      if (!(next >= 0xdc00 && next <= 0xdfff)) return true
      i++
    } else if (c >= 0xdc00 && c <= 0xdfff) {
      return true
    }
  }
  return false
}

function validId(value: unknown, label: string): asserts value is string {
  if (typeof value !== 'string' || value.length === 0 || hasUnpairedSurrogate(value)) {
    throw new SandboxCheckpointInvalidIdError(
      `${label} must be a non-empty well-formed Unicode string`,
    )
  }
}

/** Whether any string inside `v` could not travel as JSON. */
function unsendable(v: unknown): boolean {
  if (typeof v === 'string') return hasUnpairedSurrogate(v)
  if (typeof v === 'number') return !Number.isFinite(v)
  if (Array.isArray(v)) return v.some(unsendable)
  if (v !== null && typeof v === 'object') {
    return Object.entries(v).some(([k, x]) => hasUnpairedSurrogate(k) || unsendable(x))
  }
  return false
}

/** A writer as the server takes it; a malformed one is a lost writer. */
function wireWriter(w: SandboxCheckpointWriter): {
  thread_id: string
  owner_token: string
  fence: number
} {
  if (
    w === null ||
    typeof w !== 'object' ||
    typeof w.ownerToken !== 'string' ||
    hasUnpairedSurrogate(w.ownerToken) ||
    !Number.isSafeInteger(w.fence) ||
    w.fence < 0
  ) {
    throw new SandboxCheckpointWriterLostError('Checkpoint writer lease is not a lease of this store')
  }
  return { thread_id: w.threadId, owner_token: w.ownerToken, fence: w.fence }
}

const enc = encodeURIComponent

/**
 * Marks the promises `methods` of `obj` return as handled the moment they are made: a
 * caller that starts an operation, awaits other reads, and only then awaits the
 * operation (as the framework's own suites do) must not see a refusal reported as an
 * unhandled rejection meanwhile, which an in-process store never shows because it
 * settles within one turn. The caller's own await still gets the refusal.
 */
function settleEarly<T extends object>(obj: T, methods: ReadonlyArray<keyof T>): void {
  for (const m of methods) {
    const f = obj[m]
    if (typeof f !== 'function') continue
    const bound = (f as (...a: unknown[]) => unknown).bind(obj)
    Object.defineProperty(obj, m, {
      value: (...args: unknown[]) => {
        const p = bound(...args)
        if (p instanceof Promise) p.catch(() => {})
        return p
      },
      enumerable: false,
      writable: true,
      configurable: true,
    })
  }
}

/**
 * The options a store is made with on the server (the same for the checkpoint,
 * transcript and instance stores of one name, so whichever is used first makes it).
 */
function openBody(options: SandboxCheckpointStoreOptions): {
  lease_duration_ms: number
  renew_after_ms: number
  clock: 'client' | 'server'
} {
  const leaseDurationMs = options.leaseDurationMs ?? 120_000
  const renewAfterMs = options.renewAfterMs ?? 45_000
  if (!Number.isFinite(leaseDurationMs) || leaseDurationMs <= 0) {
    throw new Error('leaseDurationMs must be finite and positive')
  }
  if (!Number.isFinite(renewAfterMs) || renewAfterMs <= 0 || renewAfterMs >= leaseDurationMs) {
    throw new Error('renewAfterMs must be finite, positive, and less than leaseDurationMs')
  }
  return {
    lease_duration_ms: leaseDurationMs,
    renew_after_ms: renewAfterMs,
    clock: options.now ? 'client' : 'server',
  }
}

/** What every named store of the server needs: its client, name and clock. */
class NamedStore {
  private opened: Promise<unknown> | undefined

  constructor(
    protected readonly client: CasfsClient,
    readonly storeName: string,
    private readonly openBody: Record<string, unknown>,
  ) {}

  /** Makes the store on the server (once), then runs `f`; errors are the framework's. */
  protected async call<T>(
    request: string,
    f: () => Promise<{ data?: T; error?: unknown; response: Response }>,
  ): Promise<T> {
    this.opened ??= this.client
      .call(
        `PUT /v1/stores/${this.storeName}`,
        this.client.api.PUT('/v1/stores/{store}', {
          params: { path: { store: this.storeName } },
          body: this.openBody,
        }),
      )
      .catch((e: unknown) => {
        this.opened = undefined
        throw e
      })
    await this.opened
    try {
      return await this.client.call(request, f())
    } catch (e) {
      throw asCheckpointError(e)
    }
  }
}

export interface CasfsCheckpointStoreOptions extends SandboxCheckpointStoreOptions {
  client: CasfsClient
  /**
   * The store's name on the server (default `default`): one name, one key space of
   * threads, heads, leases and blob references. Hosts sharing one name share them.
   */
  store?: string
}

/**
 * The framework's checkpoint store on `casfs serve`. With `now`, the store is made on
 * its clients' clock (every lease operation states `now()`: a test's injected clock;
 * the server must run with `--allow-client-clocks`); without it, on the server's.
 */
export class CasfsCheckpointStore extends NamedStore implements SandboxCheckpointStore {
  private readonly now: (() => number) | undefined
  readonly leaseDurationMs: number
  readonly renewAfterMs: number

  constructor(options: CasfsCheckpointStoreOptions) {
    const body = openBody(options)
    super(options.client, options.store ?? 'default', body)
    this.now = options.now
    this.leaseDurationMs = body.lease_duration_ms
    this.renewAfterMs = body.renew_after_ms
    settleEarly(this, [
      'get',
      'list',
      'getHead',
      'append',
      'deleteHead',
      'acquireWriter',
      'listBlobReferences',
      'forkFromCheckpoint',
    ])
  }

  /** `{ now }` for a request of a lease operation on the clients' clock. */
  private stated(): { now?: number } {
    if (!this.now) return {}
    const now = this.now()
    if (!Number.isFinite(now)) throw new Error('the injected clock gave a non-finite time')
    return { now }
  }

  async get(id: string): Promise<SandboxCheckpoint | null> {
    validId(id, 'Checkpoint id')
    const r = await this.call(`GET /v1/stores/${this.storeName}/checkpoints/${enc(id)}`, () =>
      this.client.api.GET('/v1/stores/{store}/checkpoints/{id}', {
        params: { path: { store: this.storeName, id } },
      }),
    )
    return (r.checkpoint ?? null) as SandboxCheckpoint | null
  }

  async list(threadId: string): Promise<Array<SandboxCheckpoint>> {
    validId(threadId, 'Thread id')
    const r = await this.call(
      `GET /v1/stores/${this.storeName}/threads/${enc(threadId)}/checkpoints`,
      () =>
        this.client.api.GET('/v1/stores/{store}/threads/{thread}/checkpoints', {
          params: { path: { store: this.storeName, thread: threadId } },
        }),
    )
    return r as unknown as SandboxCheckpoint[]
  }

  async getHead(threadId: string): Promise<string | null> {
    validId(threadId, 'Thread id')
    const r = await this.call(`GET /v1/stores/${this.storeName}/threads/${enc(threadId)}/head`, () =>
      this.client.api.GET('/v1/stores/{store}/threads/{thread}/head', {
        params: { path: { store: this.storeName, thread: threadId } },
      }),
    )
    return r.head ?? null
  }

  async append(input: {
    checkpoint: SandboxCheckpoint
    expectedHeadId: string | null
    writer: SandboxCheckpointWriter
  }): Promise<{ headId: string }> {
    const { checkpoint, expectedHeadId, writer } = input
    // What JSON cannot carry, checked here in the framework's order; the rest the
    // server checks.
    validId(checkpoint.threadId, 'Checkpoint thread id')
    validId(writer.threadId, 'Writer thread id')
    validId(checkpoint.id, 'Checkpoint id')
    if (expectedHeadId !== null) validId(expectedHeadId, 'Expected head id')
    const parent = checkpoint.parentCheckpointId ?? null
    if (parent !== null) validId(parent, 'Parent checkpoint id')
    if (writer.threadId !== checkpoint.threadId) {
      throw new SandboxCheckpointWriterLostError(
        'Checkpoint writer thread does not match checkpoint thread',
      )
    }
    if (typeof checkpoint.createdAt !== 'number' || !Number.isFinite(checkpoint.createdAt)) {
      throw new SandboxCheckpointInvalidEntryError('Checkpoint createdAt must be a finite number')
    }
    if (unsendable(checkpoint.files) || unsendable(checkpoint.artifacts)) {
      throw new SandboxCheckpointInvalidEntryError(
        'Checkpoint entries must hold well-formed Unicode strings and finite numbers',
      )
    }
    const w = wireWriter(writer)
    const r = await this.call(`POST /v1/stores/${this.storeName}/checkpoints`, () =>
      this.client.api.POST('/v1/stores/{store}/checkpoints', {
        params: { path: { store: this.storeName } },
        body: {
          checkpoint: checkpoint as never,
          expected_head_id: expectedHeadId,
          writer: w,
          ...this.stated(),
        },
      }),
    )
    return { headId: r.head_id }
  }

  async deleteHead(input: {
    threadId: string
    checkpointId: string
    writer: SandboxCheckpointWriter
  }): Promise<void> {
    const { threadId, checkpointId, writer } = input
    validId(threadId, 'Thread id')
    validId(checkpointId, 'Checkpoint id')
    validId(writer.threadId, 'Writer thread id')
    if (writer.threadId !== threadId) {
      throw new SandboxCheckpointWriterLostError(
        'Checkpoint writer thread does not match operation thread',
      )
    }
    const w = wireWriter(writer)
    await this.call(`POST /v1/stores/${this.storeName}/heads/delete`, () =>
      this.client.api.POST('/v1/stores/{store}/heads/delete', {
        params: { path: { store: this.storeName } },
        body: { thread_id: threadId, checkpoint_id: checkpointId, writer: w, ...this.stated() },
      }),
    )
  }

  async acquireWriter(threadId: string): Promise<SandboxCheckpointWriterLease> {
    validId(threadId, 'Thread id')
    const g = await this.call(`POST /v1/stores/${this.storeName}/writers`, () =>
      this.client.api.POST('/v1/stores/{store}/writers', {
        params: { path: { store: this.storeName } },
        body: { thread_id: threadId, ...this.stated() },
      }),
    )
    const state = { expiresAt: g.expires_at }
    const wire = { thread_id: threadId, owner_token: g.owner_token, fence: g.fence }
    const lease: SandboxCheckpointWriterLease = {
      threadId,
      ownerToken: g.owner_token,
      fence: g.fence,
      get expiresAt() {
        return state.expiresAt
      },
      renewAfterMs: g.renew_after_ms,
      renew: async () => {
        const r = await this.call(`POST /v1/stores/${this.storeName}/writers/renew`, () =>
          this.client.api.POST('/v1/stores/{store}/writers/renew', {
            params: { path: { store: this.storeName } },
            body: { writer: wire, ...this.stated() },
          }),
        )
        state.expiresAt = r.expires_at
        return { expiresAt: r.expires_at }
      },
      release: async () => {
        await this.call(`POST /v1/stores/${this.storeName}/writers/release`, () =>
          this.client.api.POST('/v1/stores/{store}/writers/release', {
            params: { path: { store: this.storeName } },
            body: { writer: wire },
          }),
        )
      },
    }
    settleEarly(lease, ['renew', 'release'])
    return lease
  }

  async listBlobReferences(): Promise<Array<{ key: string; references: number }>> {
    return this.call(`GET /v1/stores/${this.storeName}/blob-references`, () =>
      this.client.api.GET('/v1/stores/{store}/blob-references', {
        params: { path: { store: this.storeName } },
      }),
    )
  }

  async forkFromCheckpoint(
    input: SandboxCheckpointForkInput,
  ): Promise<{ checkpoint: SandboxCheckpoint }> {
    validId(input.sourceThreadId, 'Source thread id')
    validId(input.sourceCheckpointId, 'Source checkpoint id')
    validId(input.destinationThreadId, 'Destination thread id')
    validId(input.destinationCheckpointId, 'Destination checkpoint id')
    validId(input.writer.threadId, 'Writer thread id')
    if (typeof input.createdAt !== 'number' || !Number.isFinite(input.createdAt)) {
      throw new SandboxCheckpointInvalidEntryError('Fork checkpoint createdAt must be a finite number')
    }
    const w = wireWriter(input.writer)
    const r = await this.call(`POST /v1/stores/${this.storeName}/forks`, () =>
      this.client.api.POST('/v1/stores/{store}/forks', {
        params: { path: { store: this.storeName } },
        body: {
          source_thread_id: input.sourceThreadId,
          source_checkpoint_id: input.sourceCheckpointId,
          destination_thread_id: input.destinationThreadId,
          destination_checkpoint_id: input.destinationCheckpointId,
          created_at: input.createdAt,
          writer: w,
          ...this.stated(),
        },
      }),
    )
    return { checkpoint: r.checkpoint as unknown as SandboxCheckpoint }
  }
}

/**
 * A thread's transcript in a casfs store: the messages a fork of {@link
 * CasfsCheckpointStore} writes in the same step as the fork root (give both the same
 * options: client, store name, lease settings and clock).
 */
export class CasfsMessageStore extends NamedStore implements MessageStore {
  constructor(options: CasfsCheckpointStoreOptions) {
    super(options.client, options.store ?? 'default', openBody(options))
    settleEarly(this, ['loadThread', 'saveThread'])
  }

  async loadThread(threadId: string): Promise<Array<ModelMessage>> {
    validId(threadId, 'Thread id')
    const r = await this.call(
      `GET /v1/stores/${this.storeName}/threads/${enc(threadId)}/messages`,
      () =>
        this.client.api.GET('/v1/stores/{store}/threads/{thread}/messages', {
          params: { path: { store: this.storeName, thread: threadId } },
        }),
    )
    return (r.messages ?? []) as ModelMessage[]
  }

  async saveThread(threadId: string, messages: Array<ModelMessage>): Promise<void> {
    validId(threadId, 'Thread id')
    await this.call(`PUT /v1/stores/${this.storeName}/threads/${enc(threadId)}/messages`, () =>
      this.client.api.PUT('/v1/stores/{store}/threads/{thread}/messages', {
        params: { path: { store: this.storeName, thread: threadId } },
        body: messages as never,
      }),
    )
  }
}

/** The framework's sandbox instance store, durable in a casfs store. */
export class CasfsInstanceStore extends NamedStore implements SandboxInstanceStore {
  constructor(options: CasfsCheckpointStoreOptions) {
    super(options.client, options.store ?? 'default', openBody(options))
    settleEarly(this, ['get', 'upsert', 'delete'])
  }

  async get(key: string): Promise<SandboxInstanceRecord | null> {
    validId(key, 'Instance key')
    const r = await this.call(`GET /v1/stores/${this.storeName}/instances/${enc(key)}`, () =>
      this.client.api.GET('/v1/stores/{store}/instances/{key}', {
        params: { path: { store: this.storeName, key } },
      }),
    )
    return (r.record ?? null) as SandboxInstanceRecord | null
  }

  async upsert(record: SandboxInstanceRecord): Promise<void> {
    validId(record.key, 'Instance key')
    await this.call(`PUT /v1/stores/${this.storeName}/instances/${enc(record.key)}`, () =>
      this.client.api.PUT('/v1/stores/{store}/instances/{key}', {
        params: { path: { store: this.storeName, key: record.key } },
        body: record as never,
      }),
    )
  }

  async delete(key: string): Promise<void> {
    validId(key, 'Instance key')
    await this.call(`DELETE /v1/stores/${this.storeName}/instances/${enc(key)}`, () =>
      this.client.api.DELETE('/v1/stores/{store}/instances/{key}', {
        params: { path: { store: this.storeName, key } },
      }),
    )
  }
}

/**
 * The stores a host hands the framework's portable snapshots, all in one casfs store:
 * the checkpoint store (with forks), the transcript store a fork writes, and the
 * sandbox instance store.
 */
export function casfsSnapshotStores(options: CasfsCheckpointStoreOptions): {
  checkpoints: CasfsCheckpointStore
  messages: CasfsMessageStore
  instances: CasfsInstanceStore
} {
  return {
    checkpoints: new CasfsCheckpointStore(options),
    messages: new CasfsMessageStore(options),
    instances: new CasfsInstanceStore(options),
  }
}
