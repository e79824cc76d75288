import { existsSync, mkdtempSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'

import { startCasfsServe, type CasfsClient, type ServeOptions, type Served } from '../src/index.js'

/** The casfs binary under test: CASFS_BIN, or this repository's build. */
export function casfsBin(): string {
  const fromEnv = process.env.CASFS_BIN
  if (fromEnv) return fromEnv
  for (const profile of ['debug', 'release']) {
    const p = resolve(import.meta.dirname, '../../../target', profile, 'casfs')
    if (existsSync(p)) return p
  }
  throw new Error(
    'no casfs binary: build it (cargo build in the repository root) or set CASFS_BIN',
  )
}

export interface TestServer {
  readonly dir: string
  /** The client of the server as it runs now. */
  readonly client: CasfsClient
  readonly served: Served
  /** Stops the server (its sandboxes are destroyed) and starts it again on its store. */
  restart(): Promise<void>
  cleanup(): Promise<void>
}

/** A server on its own store, socket and sandboxes, in a fresh temporary directory. */
export async function serve(extra: Partial<ServeOptions> = {}): Promise<TestServer> {
  const dir = mkdtempSync(join(tmpdir(), 'casfs-ts-test-'))
  const options: ServeOptions = { bin: casfsBin(), store: join(dir, 'store'), ...extra }
  let served = await startCasfsServe(options)
  return {
    dir,
    get client() {
      return served.client
    },
    get served() {
      return served
    },
    async restart() {
      await served.stop()
      served = await startCasfsServe(options)
    },
    async cleanup() {
      await served.stop()
      rmSync(dir, { recursive: true, force: true })
    },
  }
}

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms))

/** The code of a SandboxCheckpointError (or the kind of a CasfsError) `p` rejects with. */
export async function codeOf(p: Promise<unknown>): Promise<string> {
  try {
    await p
  } catch (e) {
    const x = e as { code?: string; kind?: string }
    return x.code ?? x.kind ?? String(e)
  }
  throw new Error('expected a rejection')
}

/** A TCP port of 127.0.0.1 free right now. */
export async function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const srv = createServer()
    srv.once('error', fail)
    srv.listen(0, '127.0.0.1', () => {
      const a = srv.address()
      srv.close(() => ok(typeof a === 'object' && a ? a.port : 0))
    })
  })
}
