/**
 * Processes of a casfs sandbox run by the server (`/v1/sandboxes/{key}/processes`),
 * isolated: in bubblewrap, in the sandbox's own namespaces (no network but loopback
 * unless the server allows the host's), with a read-only root, a private `/tmp` and the
 * workspace at `/workspace`, as an unprivileged user, under the server's memory, pids
 * and CPU limits and a seccomp filter (docs/middleware.md, "Sandboxes that isolate").
 * Nothing of this host is needed: the agent host may be another machine, over TCP with
 * the server's token.
 *
 * Each process leads a process group of its own in the sandbox; a kill reaches its
 * whole group, and the sandbox's destroy ends every process it started. Output is
 * followed from the server's cursor as it comes (long polls), each stream decoded as
 * UTF-8 across chunk boundaries.
 */
import { Chunks } from './chunks.js'
import type { CasfsClient } from './client.js'
import type { ExecResult, ProcessOptions, SpawnHandle } from './contracts.js'
import { CasfsError } from './errors.js'

/** What the processes of one sandbox share. */
export interface IsolatedHost {
  client: CasfsClient
  /** The sandbox's key. */
  key: string
  /** A `cwd` option as a directory inside the sandbox (`/workspace/...`). */
  cwd: (cwd: string | undefined) => string
  /** The environment of a process: the sandbox's with `extra` over it. */
  env: (extra: Record<string, string> | undefined) => Record<string, string>
  shell: string
}

/** How long one poll of a process's output waits for more (the server caps it at 30 s). */
const POLL_MS = 20_000

/** The exit code a process killed with `signal` reports. */
const KILLED = 128 + 9

const abortError = (what: string): Error =>
  Object.assign(new Error(`aborted: ${what.slice(0, 80)}`), { name: 'AbortError' })

/** One process the server runs, its output followed until it ends. */
class Followed {
  readonly stdout = new Chunks()
  readonly stderr = new Chunks()
  readonly exited: Promise<number>

  constructor(
    private readonly host: IsolatedHost,
    readonly id: number,
    readonly pid: number,
  ) {
    this.exited = this.follow()
    this.exited.catch(() => {})
  }

  private async follow(): Promise<number> {
    const { client, key } = this.host
    let after = 0
    try {
      for (;;) {
        const o = await client.call(
          `GET /v1/sandboxes/${key}/processes/${this.id}`,
          client.api.GET('/v1/sandboxes/{key}/processes/{id}', {
            params: { path: { key, id: this.id }, query: { after, wait_ms: POLL_MS } },
          }),
        )
        for (const c of o.chunks) {
          const bytes = Buffer.from(c.data_base64, 'base64')
          ;(c.stream === 'stderr' ? this.stderr : this.stdout).push(bytes)
        }
        after = o.next
        if (o.exit_code !== null && o.exit_code !== undefined) return o.exit_code
      }
    } catch (e) {
      // The sandbox was destroyed (its processes with it), or the process forgotten.
      if (e instanceof CasfsError && e.kind === 'not_found') return KILLED
      throw e
    } finally {
      this.stdout.end()
      this.stderr.end()
    }
  }

  async kill(signal: NodeJS.Signals | number = 'SIGTERM'): Promise<void> {
    const { client, key } = this.host
    try {
      await client.call(
        `POST /v1/sandboxes/${key}/processes/${this.id}/kill`,
        client.api.POST('/v1/sandboxes/{key}/processes/{id}/kill', {
          params: { path: { key, id: this.id } },
          body: { signal },
        }),
      )
    } catch (e) {
      // Gone already: ended, or its sandbox destroyed.
      if (e instanceof CasfsError && e.kind === 'not_found') return
      throw e
    }
  }

  async write(data: string, end: boolean): Promise<void> {
    const { client, key } = this.host
    await client.call(
      `POST /v1/sandboxes/${key}/processes/${this.id}/stdin`,
      client.api.POST('/v1/sandboxes/{key}/processes/{id}/stdin', {
        params: { path: { key, id: this.id } },
        body: { data, end },
      }),
    )
  }
}

/** The processes of one sandbox, run isolated by the server. */
export class IsolatedProcesses {
  private readonly live = new Set<Followed>()

  constructor(private readonly host: IsolatedHost) {}

  private async start(
    command: string,
    options: ProcessOptions | undefined,
    stdin: boolean,
  ): Promise<Followed> {
    if (options?.signal?.aborted) {
      throw Object.assign(new Error('the operation was aborted before it started'), {
        name: 'AbortError',
      })
    }
    const { client, key } = this.host
    const r = await client.call(
      `POST /v1/sandboxes/${key}/processes`,
      client.api.POST('/v1/sandboxes/{key}/processes', {
        params: { path: { key } },
        body: {
          argv: [this.host.shell, '-c', command],
          cwd: this.host.cwd(options?.cwd),
          env: this.host.env(options?.env),
          stdin,
        },
      }),
    )
    const p = new Followed(this.host, r.id, r.pid ?? -1)
    this.live.add(p)
    void p.exited.finally(() => this.live.delete(p)).catch(() => {})
    const signal = options?.signal
    if (signal) {
      const onAbort = (): void => void p.kill('SIGKILL').catch(() => {})
      if (signal.aborted) onAbort()
      else {
        signal.addEventListener('abort', onAbort, { once: true })
        void p.exited.finally(() => signal.removeEventListener('abort', onAbort)).catch(() => {})
      }
    }
    return p
  }

  /** Runs `command` to its end; its output whole. */
  async exec(command: string, options?: ProcessOptions): Promise<ExecResult> {
    const p = await this.start(command, options, false)
    const exitCode = await p.exited
    if (options?.signal?.aborted) throw abortError(command)
    return { stdout: p.stdout.text(), stderr: p.stderr.text(), exitCode }
  }

  /** Starts `command` in the background, its stdin open for writes. */
  async spawn(command: string, options?: ProcessOptions): Promise<SpawnHandle> {
    const p = await this.start(command, options, true)
    let stdinEnded = false
    return {
      pid: p.pid,
      stdout: p.stdout,
      stderr: p.stderr,
      stdin: {
        write: (data) => p.write(data, false),
        end: async () => {
          if (stdinEnded) return
          stdinEnded = true
          await p.write('', true).catch((e: unknown) => {
            // Closed already (the process ended): nothing to end.
            if (!(e instanceof CasfsError)) throw e
          })
        },
      },
      wait: () => p.exited,
      kill: (signal) => p.kill(signal ?? 'SIGTERM'),
    }
  }

  /** Ends every process of the sandbox this provider started (SIGKILL to each group). */
  async killAll(): Promise<void> {
    const live = [...this.live]
    await Promise.all(live.map((p) => p.kill('SIGKILL').catch(() => {})))
    await Promise.all(live.map((p) => p.exited.catch(() => {})))
  }
}
