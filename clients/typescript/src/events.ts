/**
 * A casfs sandbox's file events (`GET /v1/sandboxes/{key}/events`): every create,
 * modify, delete and rename in the mounted workspace, numbered by the server without
 * gaps, read by long polls as an async iterator.
 */
import type { CasfsClient, Schemas } from './client.js'
import { CasfsError } from './errors.js'

export type FileEvent = Schemas['FileEvent']
export type FileChange = Schemas['FileChange']

export interface EventsOptions {
  /**
   * Start after this sequence number (default 0: every event the server kept since it
   * began recording, at creation or at the first events request).
   */
  after?: number
  /** How long one request waits for new events (default 10,000 ms; at most 30,000). */
  waitMs?: number
  /** Ends the iteration. */
  signal?: AbortSignal
}

/** The number of the last event the server kept of sandbox `key` (0: none yet). */
export async function lastEvent(client: CasfsClient, key: string): Promise<number> {
  const batch = await client.call(
    `GET /v1/sandboxes/${encodeURIComponent(key)}/events`,
    client.api.GET('/v1/sandboxes/{key}/events', {
      params: { path: { key }, query: { after: 0 } },
    }),
  )
  let last = 0
  for (const ev of batch) last = Math.max(last, ev.kind === 'lost' ? ev.seq + ev.count - 1 : ev.seq)
  return last
}

/**
 * The sandbox's file events in order, as they happen; ends when `signal` aborts or the
 * sandbox is destroyed. A `lost` event says events were dropped (the reader fell more
 * than the server's `--max-events` behind).
 */
export async function* sandboxEvents(
  client: CasfsClient,
  key: string,
  options: EventsOptions = {},
): AsyncGenerator<FileEvent, void, undefined> {
  let after = options.after ?? 0
  const waitMs = options.waitMs ?? 10_000
  const signal = options.signal
  while (!signal?.aborted) {
    let batch: FileEvent[]
    try {
      batch = await client.call(
        `GET /v1/sandboxes/${encodeURIComponent(key)}/events`,
        client.api.GET('/v1/sandboxes/{key}/events', {
          params: { path: { key }, query: { after, wait_ms: waitMs } },
          ...(signal ? { signal } : {}),
        }),
      )
    } catch (e) {
      if (signal?.aborted) return
      // Destroyed (by us, at the cap, or the server stopping): nothing more will come.
      if (e instanceof CasfsError && e.kind === 'not_found') return
      throw e
    }
    for (const ev of batch) {
      if (signal?.aborted) return
      after = ev.kind === 'lost' ? ev.seq + ev.count - 1 : Math.max(after, ev.seq)
      yield ev
    }
  }
}
