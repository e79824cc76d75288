/**
 * casfs as an agent framework's sandbox checkpoint store: writer leases with renewal,
 * the thread's head, checkpoints by id, and append with compare-and-swap on the head
 * under the writer's lease. casfs checks the fencing token and the head in one atomic
 * step, so the framework's rules (never publish after a lost lease, never over a head
 * that moved) hold across processes and hosts, not only within one.
 */
import type { CasfsClient, Schemas } from './client.js'
import {
  asCheckpointError,
  CasfsError,
  SandboxCheckpointError,
} from './errors.js'

export type Checkpoint = Schemas['Checkpoint']
export type Lease = Schemas['Lease']

/** What {@link CasfsCheckpointStore.append} publishes. */
export interface CheckpointInput {
  threadId: string
  /** The sandbox whose workspace is captured: its key, or the sandbox itself. */
  sandbox: string | { key: string }
  reason?: string
  sourceRunId?: string
  /**
   * The conversation stored with the checkpoint (any JSON messages); absent: the
   * thread's messages on the server.
   */
  conversation?: ReadonlyArray<unknown>
}

/** The result of an append: the checkpoint record, and what the capture saw. */
export interface Appended {
  checkpoint: Checkpoint
  changedFiles: number
  /** Files the capture policy left out. */
  skipped: string[]
  /** Files stored with secret values replaced by placeholders. */
  secretFiles: number
}

/** A thread's writer lease, as the framework uses it. */
export class CasfsWriterLease {
  private current: Lease
  private state: 'held' | 'released' | 'lost' = 'held'
  private lostError: SandboxCheckpointError | undefined
  private releasing: Promise<void> | undefined

  constructor(
    private readonly client: CasfsClient,
    lease: Lease,
  ) {
    this.current = lease
  }

  get threadId(): string {
    return this.current.thread
  }
  get holder(): string {
    return this.current.holder
  }
  /** The fencing token: larger than any earlier lease's on the thread. */
  get token(): number {
    return this.current.token
  }
  /** When to renew next, in milliseconds from the last acquire or renewal. */
  get renewAfterMs(): number {
    return this.current.renew_after_ms ?? Math.floor(this.current.ttl_ms / 3)
  }
  /** When it expires unless renewed (ms since the epoch, the server's clock). */
  get expiresAt(): number {
    return this.current.expires_at_ms
  }
  /** The lease as the server answered it last (it holds the owner secret). */
  get record(): Lease {
    return this.current
  }
  /** What proves this writer to the server: the fencing token and the owner secret. */
  get proof(): Schemas['WriterProof'] {
    return { token: this.current.token, owner_token: this.current.owner_token }
  }
  /** Whether it is still this writer's (not released, no renewal failed). */
  get held(): boolean {
    return this.state === 'held'
  }
  /** Why it was lost, if a renewal failed. */
  get lost(): SandboxCheckpointError | undefined {
    return this.lostError
  }

  /** Throws unless the lease is still held here: a writer must not publish otherwise. */
  assertHeld(): void {
    if (this.state === 'lost' && this.lostError) throw this.lostError
    if (this.state !== 'held') {
      throw new SandboxCheckpointError(
        'SANDBOX_SNAPSHOT_LEASE_LOST',
        `the writer lease on thread '${this.threadId}' (token ${this.token}) was released`,
      )
    }
  }

  /**
   * Extends the lease by its TTL. A refusal (expired, taken over) or any failure to
   * renew loses the lease for good: every later renew and append is refused.
   */
  async renew(): Promise<void> {
    this.assertHeld()
    const t = encodeURIComponent(this.threadId)
    try {
      this.current = await this.client.call(
        `POST /v1/threads/${t}/writer/renew`,
        this.client.api.POST('/v1/threads/{thread}/writer/renew', {
          params: { path: { thread: this.threadId } },
          body: this.proof,
        }),
      )
    } catch (e) {
      const err = asCheckpointError(e)
      this.lostError =
        err instanceof SandboxCheckpointError && err.code === 'SANDBOX_SNAPSHOT_LEASE_LOST'
          ? err
          : new SandboxCheckpointError(
              'SANDBOX_SNAPSHOT_LEASE_LOST',
              `renewing the writer lease on thread '${this.threadId}' failed: ${
                e instanceof Error ? e.message : String(e)
              }`,
              { cause: e },
            )
      this.state = 'lost'
      throw this.lostError
    }
  }

  /**
   * Gives the lease up (once; repeats wait for the first). A lease lost to another
   * writer is not an error to release: there is nothing left to give up.
   */
  release(): Promise<void> {
    if (this.releasing) return this.releasing
    const wasHeld = this.state === 'held'
    this.state = this.state === 'lost' ? 'lost' : 'released'
    this.releasing = (async () => {
      if (!wasHeld) return
      const t = encodeURIComponent(this.threadId)
      try {
        await this.client.call(
          `POST /v1/threads/${t}/writer/release`,
          this.client.api.POST('/v1/threads/{thread}/writer/release', {
            params: { path: { thread: this.threadId } },
            body: this.proof,
          }),
        )
      } catch (e) {
        if (e instanceof CasfsError && (e.kind === 'lease_lost' || e.kind === 'lease_expired'))
          return
        throw asCheckpointError(e)
      }
    })()
    return this.releasing
  }

  /**
   * Renews in the background at {@link renewAfterMs} until released or lost; `onLost`
   * hears a failed renewal once. Returns a function that stops renewing.
   */
  keepAlive(onLost?: (e: SandboxCheckpointError) => void): () => void {
    let timer: ReturnType<typeof setTimeout> | undefined
    let stopped = false
    const schedule = (): void => {
      timer = setTimeout(() => {
        if (stopped || !this.held) return
        this.renew().then(schedule, (e: unknown) => {
          if (!stopped && e instanceof SandboxCheckpointError) onLost?.(e)
        })
      }, this.renewAfterMs)
      timer.unref?.()
    }
    schedule()
    return () => {
      stopped = true
      if (timer !== undefined) clearTimeout(timer)
    }
  }
}

export interface AcquireOptions {
  /** Who holds it, as a refusal names it (default: the server with a random tag). */
  holder?: string
  /** Default: the server's `--lease-ttl`. */
  ttlMs?: number
}

/** The framework's checkpoint store, on `casfs serve`. */
export class CasfsCheckpointStore {
  constructor(private readonly client: CasfsClient) {}

  /**
   * Takes the thread's writer lease. Another live writer: `SANDBOX_SNAPSHOT_LEASE_HELD`.
   */
  async acquireWriter(threadId: string, options: AcquireOptions = {}): Promise<CasfsWriterLease> {
    const body: Schemas['Acquire'] = {}
    if (options.holder !== undefined) body.holder = options.holder
    if (options.ttlMs !== undefined) body.ttl_ms = options.ttlMs
    try {
      const lease = await this.client.call(
        `POST /v1/threads/${encodeURIComponent(threadId)}/writer`,
        this.client.api.POST('/v1/threads/{thread}/writer', {
          params: { path: { thread: threadId } },
          body,
        }),
      )
      return new CasfsWriterLease(this.client, lease)
    } catch (e) {
      throw asCheckpointError(e)
    }
  }

  /** The thread's head checkpoint id, or null for a thread with none. */
  async getHead(threadId: string): Promise<string | null> {
    try {
      const h = await this.client.call(
        `GET /v1/threads/${encodeURIComponent(threadId)}/head`,
        this.client.api.GET('/v1/threads/{thread}/head', {
          params: { path: { thread: threadId } },
        }),
      )
      return h.head
    } catch (e) {
      throw asCheckpointError(e)
    }
  }

  /** A checkpoint by id, or null if the store has none of that id. */
  async get(checkpointId: string): Promise<Checkpoint | null> {
    try {
      return await this.client.call(
        `GET /v1/checkpoints/${encodeURIComponent(checkpointId)}`,
        this.client.api.GET('/v1/checkpoints/{id}', {
          params: { path: { id: checkpointId } },
        }),
      )
    } catch (e) {
      if (e instanceof CasfsError && e.kind === 'not_found') return null
      throw asCheckpointError(e)
    }
  }

  /** The thread's checkpoints, newest first. */
  async log(threadId: string, limit = 100): Promise<Checkpoint[]> {
    try {
      return await this.client.call(
        `GET /v1/threads/${encodeURIComponent(threadId)}/checkpoints`,
        this.client.api.GET('/v1/threads/{thread}/checkpoints', {
          params: { path: { thread: threadId }, query: { limit } },
        }),
      )
    } catch (e) {
      throw asCheckpointError(e)
    }
  }

  /**
   * Captures the sandbox and appends it as the thread's head, if the head is still
   * `expectedHeadId` and `writer` is the thread's current lease. Refusals:
   * `SANDBOX_SNAPSHOT_LEASE_LOST` (expired, taken over, released, or a renewal failed
   * here), `SANDBOX_SNAPSHOT_HEAD_MISMATCH` (the head moved).
   */
  async append(input: {
    checkpoint: CheckpointInput
    expectedHeadId: string | null | undefined
    writer: CasfsWriterLease
  }): Promise<Appended> {
    const { checkpoint: c, writer } = input
    if (!(writer instanceof CasfsWriterLease)) {
      throw new SandboxCheckpointError(
        'SANDBOX_SNAPSHOT_STORE_ERROR',
        'append needs a writer lease from this store\'s acquireWriter',
      )
    }
    writer.assertHeld()
    if (writer.threadId !== c.threadId) {
      throw new SandboxCheckpointError(
        'SANDBOX_SNAPSHOT_STORE_ERROR',
        `the lease is for thread '${writer.threadId}', the checkpoint for '${c.threadId}'`,
      )
    }
    const body: Schemas['Append'] = {
      sandbox: typeof c.sandbox === 'string' ? c.sandbox : c.sandbox.key,
      expected_head: input.expectedHeadId ?? null,
      writer: writer.proof,
    }
    if (c.reason !== undefined) body.reason = c.reason
    if (c.sourceRunId !== undefined) body.source_run_id = c.sourceRunId
    if (c.conversation !== undefined) body.conversation = [...c.conversation]
    try {
      const r = await this.client.call(
        `POST /v1/threads/${encodeURIComponent(c.threadId)}/checkpoints`,
        this.client.api.POST('/v1/threads/{thread}/checkpoints', {
          params: { path: { thread: c.threadId } },
          body,
        }),
      )
      return {
        checkpoint: r.checkpoint,
        changedFiles: r.changed_files,
        skipped: r.skipped,
        secretFiles: r.secret_files,
      }
    } catch (e) {
      throw asCheckpointError(e)
    }
  }
}
