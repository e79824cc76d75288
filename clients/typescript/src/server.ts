/**
 * Runs `casfs serve` as a child process on its own socket: for hosts that keep casfs
 * beside the agent, for tests and for the example.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { existsSync } from 'node:fs'
import { join } from 'node:path'

import { CasfsClient } from './client.js'
import { CasfsError } from './errors.js'

export interface ServeOptions {
  /** The casfs binary (default: `casfs` on PATH). */
  bin?: string
  /** The store directory (created if missing). */
  store: string
  /** Where sandboxes are mounted (default: `<store>/sandboxes`). */
  sandboxes?: string
  /** The socket (default: `<store>.sock` beside the store). */
  socketPath?: string
  /**
   * Serve loopback TCP on this port instead of the socket, with this bearer token
   * (passed to the server in `CASFS_TOKEN`).
   */
  listen?: { port: number; token: string }
  /** More arguments of `casfs serve` (`--lease-ttl 2`, `--secret NAME`, `--diffs` ...). */
  args?: string[]
  /** The server's environment (default: this process's). */
  env?: NodeJS.ProcessEnv
  /** How long to wait for the server to answer (default 30,000 ms). */
  startTimeoutMs?: number
}

/** A running `casfs serve`. */
export interface Served {
  /** The socket it serves (unused with `listen`). */
  readonly socketPath: string
  readonly client: CasfsClient
  readonly process: ChildProcess
  /** What the server wrote to stderr so far (its log). */
  log(): string
  /** SIGTERM, then SIGKILL after `graceMs` (default 10,000); sandboxes are destroyed. */
  stop(graceMs?: number): Promise<void>
}

export async function startCasfsServe(options: ServeOptions): Promise<Served> {
  const socketPath = options.socketPath ?? `${options.store}.sock`
  const listen = options.listen
  const args = [
    '--store',
    options.store,
    'serve',
    ...(listen ? ['--listen', `127.0.0.1:${listen.port}`] : ['--socket', socketPath]),
    '--sandboxes',
    options.sandboxes ?? join(options.store, 'sandboxes'),
    ...(options.args ?? []),
  ]
  const env = { ...(options.env ?? process.env) }
  if (listen) env.CASFS_TOKEN = listen.token
  const child = spawn(options.bin ?? 'casfs', args, {
    env,
    stdio: ['ignore', 'ignore', 'pipe'],
  })
  let log = ''
  child.stderr?.setEncoding('utf8')
  child.stderr?.on('data', (d: string) => {
    log = (log + d).slice(-64 * 1024)
  })
  let exited: number | string | null | undefined
  const exit = new Promise<void>((resolve) => {
    child.once('exit', (code, sig) => {
      exited = code ?? sig
      resolve()
    })
    child.once('error', (e) => {
      exited = e.message
      resolve()
    })
  })
  const client = listen
    ? new CasfsClient({ baseUrl: `http://127.0.0.1:${listen.port}`, token: listen.token })
    : new CasfsClient({ socketPath })
  const served: Served = {
    socketPath,
    client,
    process: child,
    log: () => log,
    async stop(graceMs = 10_000) {
      await client.close()
      if (exited !== undefined) return
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
      await exit
      clearTimeout(timer)
    },
  }
  const deadline = Date.now() + (options.startTimeoutMs ?? 30_000)
  for (;;) {
    if (exited !== undefined) {
      throw new CasfsError(
        'unreachable',
        `casfs serve exited (${exited}) before answering: ${log.trim()}`,
        0,
        'start',
      )
    }
    if (listen || existsSync(socketPath)) {
      try {
        await client.health()
        return served
      } catch {
        // Not answering yet.
      }
    }
    if (Date.now() > deadline) {
      await served.stop(1000)
      throw new CasfsError(
        'unreachable',
        `casfs serve did not answer on ${socketPath} in time: ${log.trim()}`,
        0,
        'start',
      )
    }
    await new Promise((r) => setTimeout(r, 50))
  }
}
