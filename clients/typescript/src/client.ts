/**
 * The typed client of `casfs serve`: every route of docs/openapi.json, with types
 * generated from it at build time (openapi-typescript) and calls made by openapi-fetch,
 * over the server's Unix socket or over loopback TCP with its bearer token.
 */
import createClient, { type Client } from 'openapi-fetch'
import { Agent, fetch as undiciFetch } from 'undici'

import { CasfsError, type CasfsErrorKind } from './errors.js'
import type { components, paths } from './generated/api.js'

export type { components, paths }
export type Schemas = components['schemas']

/** Where the server listens. */
export type ConnectOptions =
  | {
      /** The server's Unix socket (`casfs serve --socket`). */
      socketPath: string
      /** Per-request timeout in milliseconds (default 120,000). */
      timeoutMs?: number
    }
  | {
      /** `http://127.0.0.1:PORT` (`casfs serve --listen`): loopback only. */
      baseUrl: string
      /** The server's token (`CASFS_TOKEN`). */
      token: string
      timeoutMs?: number
    }

/** The raw openapi-fetch client: every route, typed. */
export type CasfsApi = Client<paths>

/** A connection to `casfs serve`. */
export class CasfsClient {
  /** Every route of the API, typed; answers are `{ data, error, response }`. */
  readonly api: CasfsApi
  private readonly agent: Agent | undefined

  constructor(options: ConnectOptions) {
    const timeoutMs = options.timeoutMs ?? 120_000
    if ('socketPath' in options) {
      const agent = new Agent({
        connect: { socketPath: options.socketPath },
        headersTimeout: timeoutMs,
        bodyTimeout: timeoutMs,
      })
      this.agent = agent
      this.api = createClient<paths>({
        baseUrl: 'http://casfs.sock',
        fetch: async (req: Request): Promise<Response> => {
          const body = req.body === null ? undefined : Buffer.from(await req.arrayBuffer())
          const res = await undiciFetch(req.url, {
            method: req.method,
            headers: [...req.headers.entries()],
            ...(body === undefined ? {} : { body }),
            dispatcher: agent,
            signal: req.signal,
          })
          return res as unknown as Response
        },
      })
    } else {
      const url = new URL(options.baseUrl)
      if (!['127.0.0.1', 'localhost', '[::1]'].includes(url.hostname)) {
        throw new CasfsError(
          'invalid',
          `${options.baseUrl}: casfs serve listens on loopback only`,
          0,
          'connect',
        )
      }
      this.agent = undefined
      this.api = createClient<paths>({
        baseUrl: url.origin,
        headers: { Authorization: `Bearer ${options.token}` },
        fetch: (req: Request) => globalThis.fetch(req, { signal: AbortSignal.timeout(timeoutMs) }),
      })
    }
  }

  /** Closes the connection pool (Unix socket). */
  async close(): Promise<void> {
    await this.agent?.close()
  }

  /**
   * The data of an answer, or a {@link CasfsError} with the server's kind. `request`
   * names the call in the error (`METHOD path`).
   */
  async call<T>(
    request: string,
    p: Promise<{ data?: T; error?: unknown; response: Response }>,
  ): Promise<T> {
    let r: { data?: T; error?: unknown; response: Response }
    try {
      r = await p
    } catch (e) {
      throw new CasfsError('unreachable', describe(e), 0, request, { cause: e })
    }
    if (r.response.ok && r.data !== undefined) return r.data
    const body = r.error as { error?: { kind?: string; message?: string } } | undefined
    const kind = body?.error?.kind
    if (typeof kind === 'string') {
      throw new CasfsError(
        kind as CasfsErrorKind,
        body?.error?.message ?? '',
        r.response.status,
        request,
      )
    }
    throw new CasfsError(
      'bad_response',
      `HTTP ${r.response.status} without the API's error body`,
      r.response.status,
      request,
    )
  }

  /** The server's version (and that it answers). */
  async health(): Promise<{ ok: boolean; version: string }> {
    const h = await this.call('GET /v1/health', this.api.GET('/v1/health'))
    return h as { ok: boolean; version: string }
  }
}

function describe(e: unknown): string {
  if (e instanceof Error) {
    const cause = (e as { cause?: unknown }).cause
    return cause instanceof Error ? `${e.message}: ${cause.message}` : e.message
  }
  return String(e)
}

/** Connects to `casfs serve` (no request is made until the first call). */
export function connect(options: ConnectOptions): CasfsClient {
  return new CasfsClient(options)
}
