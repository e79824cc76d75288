// The typed client: the Unix socket, loopback TCP with the bearer token, errors as
// CasfsError with the server's kind, and the example run end to end.
import { execFile } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { existsSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { promisify } from 'node:util'

import { afterAll, beforeAll, describe, expect, test } from 'vitest'

import { CasfsCheckpointStore, CasfsError, connect } from '../src/index.js'
import { casfsBin, freePort, serve } from './helpers.js'

const run = promisify(execFile)

/** A free loopback port. */
describe('client', () => {
  let s: Awaited<ReturnType<typeof serve>>
  beforeAll(async () => {
    s = await serve()
  })
  afterAll(async () => {
    await s?.cleanup()
  })

  test('the typed client over the Unix socket', async () => {
    const h = await s.client.health()
    expect(h.ok).toBe(true)
    expect(h.version).toMatch(/^\d+\.\d+\.\d+/)
    const { data, response } = await s.client.api.GET('/v1/threads')
    expect(response.status).toBe(200)
    expect(Array.isArray(data)).toBe(true)
    // Messages round-trip through the typed routes.
    await s.client.call(
      'PUT messages',
      s.client.api.PUT('/v1/threads/{thread}/messages', {
        params: { path: { thread: 'msgs' } },
        body: [{ role: 'user', content: 'ünïcødé "quoted" \\ back' }],
      }),
    )
    const got = await s.client.call(
      'GET messages',
      s.client.api.GET('/v1/threads/{thread}/messages', { params: { path: { thread: 'msgs' } } }),
    )
    expect(got).toEqual([{ role: 'user', content: 'ünïcødé "quoted" \\ back' }])
  })

  test('errors carry the server kind and status', async () => {
    const e = await s.client
      .call('GET log', s.client.api.GET('/v1/threads/{thread}/checkpoints', {
        params: { path: { thread: '@bad' }, query: {} },
      }))
      .catch((x: unknown) => x)
    expect(e).toBeInstanceOf(CasfsError)
    expect((e as CasfsError).kind).toBe('invalid')
    expect((e as CasfsError).status).toBe(400)
    const nf = await s.client
      .call('GET cp', s.client.api.GET('/v1/checkpoints/{id}', { params: { path: { id: 'abcd1234' } } }))
      .catch((x: unknown) => x)
    expect((nf as CasfsError).kind).toBe('not_found')
    expect((nf as CasfsError).status).toBe(404)
  })

  test('a server that is not there is `unreachable`, not a hang', async () => {
    const c = connect({ socketPath: join(s.dir, 'nobody.sock'), timeoutMs: 5000 })
    const e = await c.health().catch((x: unknown) => x)
    expect((e as CasfsError).kind).toBe('unreachable')
    expect((e as CasfsError).status).toBe(0)
    await c.close()
    expect(() => connect({ baseUrl: 'http://example.com:80', token: 't' })).toThrow(/loopback/)
  })

  test('loopback TCP needs the bearer token', async () => {
    const port = await freePort()
    const token = randomBytes(24).toString('hex')
    const tcp = await serve({ listen: { port, token } })
    try {
      const store = new CasfsCheckpointStore({ client: tcp.client, store: 'tcp' })
      const w = await store.acquireWriter('over-tcp')
      expect(await store.getHead('over-tcp')).toBeNull()
      await w.release()
      const bad = connect({ baseUrl: `http://127.0.0.1:${port}`, token: 'wrong', timeoutMs: 5000 })
      const e = await bad.health().catch((x: unknown) => x)
      expect((e as CasfsError).kind).toBe('unauthorized')
      expect((e as CasfsError).status).toBe(401)
      const none = connect({ baseUrl: `http://127.0.0.1:${port}`, token: '', timeoutMs: 5000 })
      expect(((await none.health().catch((x: unknown) => x)) as CasfsError).kind).toBe(
        'unauthorized',
      )
    } finally {
      await tcp.cleanup()
    }
  })
})

describe('package', () => {
  test('the built package loads as plain ESM in Node, with its types beside it', async () => {
    const root = resolve(import.meta.dirname, '..')
    const { stdout } = await run(
      process.execPath,
      [
        '--input-type=module',
        '-e',
        "const m = await import('casfs'); console.log(Object.keys(m).sort().join(','))",
      ],
      { cwd: root },
    )
    expect(stdout.trim().split(',')).toEqual(
      expect.arrayContaining([
        'CasfsCheckpointStore',
        'CasfsClient',
        'CasfsError',
        'CasfsInstanceStore',
        'CasfsMessageStore',
        'SandboxCheckpointError',
        'SandboxCheckpointWriterLostError',
        'casfsSandbox',
        'casfsSnapshotStores',
        'connect',
        'startCasfsServe',
      ]),
    )
    expect(existsSync(join(root, 'dist', 'index.d.ts'))).toBe(true)
  })
})

describe('example', () => {
  test('examples/agent-loop.ts runs end to end', async () => {
    const root = resolve(import.meta.dirname, '..')
    const { stdout } = await run(
      process.execPath,
      ['--import', 'tsx', 'examples/agent-loop.ts'],
      { cwd: root, env: { ...process.env, CASFS_BIN: casfsBin() }, timeout: 120_000 },
    )
    expect(stdout).toContain('run-1: sandbox created')
    expect(stdout).toContain('run-1: the shell made main.py')
    expect(stdout).toMatch(/run-1: snapshot [0-9a-f]{12}/)
    expect(stdout).toMatch(/run-2: sandbox restored [0-9a-f]{12}/)
    expect(stdout).toMatch(/run-2: resumed plan\.md from run-1: .*step one/)
    expect(stdout).toMatch(/latest: [0-9a-f]{12} \(after run-2\)/)
  })
})
