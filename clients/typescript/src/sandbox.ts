/**
 * A sandbox provider on `casfs serve`: one casfs-mounted workspace per thread (and
 * tenant), created or resumed showing the thread's head, destroyed with its uncaptured
 * work, and its file events as an async iterator.
 */
import type { CasfsClient, Schemas } from './client.js'
import { CasfsError } from './errors.js'

export type FileEvent = Schemas['FileEvent']
export type FileChange = Schemas['FileChange']

export interface EventsOptions {
  /** Start after this sequence number (default 0: every event the server kept). */
  after?: number
  /** How long one request waits for new events (default 10,000 ms; at most 30,000). */
  waitMs?: number
  /** Ends the iteration. */
  signal?: AbortSignal
}

/** A thread's casfs-mounted workspace. */
export class CasfsSandbox {
  constructor(
    private readonly client: CasfsClient,
    private readonly info: Schemas['CreatedSandbox'],
  ) {}

  get key(): string {
    return this.info.key
  }
  /** The workspace directory on the server's host. */
  get path(): string {
    return this.info.path
  }
  get threadId(): string {
    return this.info.thread
  }
  /** `created` (new, at the head), `resumed` (alive, as last left) or `native_restored`. */
  get outcome(): Schemas['CreatedSandbox']['outcome'] {
    return this.info.outcome
  }
  /** Whether this call put the head checkpoint in it. */
  get restored(): boolean {
    return this.info.restored
  }
  /** The checkpoint the workspace shows (the head its next append goes on). */
  get base(): string | null {
    return this.info.base
  }
  /** `fuse` or `overlay` for a mount. */
  get mode(): string | null | undefined {
    return this.info.mode
  }

  /**
   * The workspace's file events, in order, as they happen; ends when `signal` aborts
   * or the sandbox is destroyed. A `lost` event says events were dropped (the reader
   * fell more than the server's `--max-events` behind).
   */
  async *events(options: EventsOptions = {}): AsyncGenerator<FileEvent, void, undefined> {
    let after = options.after ?? 0
    const waitMs = options.waitMs ?? 10_000
    const signal = options.signal
    while (!signal?.aborted) {
      let batch: FileEvent[]
      try {
        batch = await this.client.call(
          `GET /v1/sandboxes/${encodeURIComponent(this.key)}/events`,
          this.client.api.GET('/v1/sandboxes/{key}/events', {
            params: { path: { key: this.key }, query: { after, wait_ms: waitMs } },
            ...(signal ? { signal } : {}),
          }),
        )
      } catch (e) {
        if (signal?.aborted) return
        // Destroyed (by us, a run's end, or the idle reaper): nothing more will come.
        if (e instanceof CasfsError && e.kind === 'not_found') return
        throw e
      }
      for (const ev of batch) {
        // Aborted while the reader handled the last one: nothing more.
        if (signal?.aborted) return
        after = ev.kind === 'lost' ? ev.seq + ev.count - 1 : Math.max(after, ev.seq)
        yield ev
      }
    }
  }

  /** Unmounts the sandbox and discards its uncaptured work. */
  async destroy(): Promise<boolean> {
    const r = await this.client.call(
      `DELETE /v1/sandboxes/${encodeURIComponent(this.key)}`,
      this.client.api.DELETE('/v1/sandboxes/{key}', { params: { path: { key: this.key } } }),
    )
    return r.destroyed
  }
}

/** Makes and tears down the casfs sandboxes of threads. */
export class CasfsSandboxProvider {
  constructor(
    private readonly client: CasfsClient,
    private readonly defaults: { tenant?: string } = {},
  ) {}

  /**
   * The thread's sandbox: the live one (resumed as the last writer left it, unless
   * the head moved since: then it shows the head), or a new one at the head.
   */
  async create(threadId: string, options: { tenant?: string } = {}): Promise<CasfsSandbox> {
    const tenant = options.tenant ?? this.defaults.tenant
    const body: Schemas['NewSandbox'] = { thread: threadId }
    if (tenant !== undefined) body.tenant = tenant
    const info = await this.client.call(
      'POST /v1/sandboxes',
      this.client.api.POST('/v1/sandboxes', { body }),
    )
    return new CasfsSandbox(this.client, info)
  }

  /** The same as {@link create}: casfs resumes a live sandbox of the thread. */
  resume(threadId: string, options: { tenant?: string } = {}): Promise<CasfsSandbox> {
    return this.create(threadId, options)
  }

  /** Destroys a sandbox by key (false if none was live). */
  async destroy(sandbox: string | { key: string }): Promise<boolean> {
    const key = typeof sandbox === 'string' ? sandbox : sandbox.key
    const r = await this.client.call(
      `DELETE /v1/sandboxes/${encodeURIComponent(key)}`,
      this.client.api.DELETE('/v1/sandboxes/{key}', { params: { path: { key } } }),
    )
    return r.destroyed
  }

  /** The live sandboxes. */
  async list(): Promise<Schemas['Sandbox'][]> {
    return this.client.call('GET /v1/sandboxes', this.client.api.GET('/v1/sandboxes'))
  }
}
