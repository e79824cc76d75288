// The sandbox provider against a real `casfs serve`: create, resume, destroy, a new
// sandbox showing the head (uncaptured work gone), and file events as an async iterator.
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'

import { afterAll, beforeAll, describe, expect, test } from 'vitest'

import {
  CasfsCheckpointStore,
  CasfsError,
  CasfsSandboxProvider,
  type FileEvent,
} from '../src/index.js'
import { serve } from './helpers.js'

let s: Awaited<ReturnType<typeof serve>>
let store: CasfsCheckpointStore
let sandboxes: CasfsSandboxProvider

beforeAll(async () => {
  s = await serve()
  store = new CasfsCheckpointStore(s.client)
  sandboxes = new CasfsSandboxProvider(s.client)
})

afterAll(async () => {
  await s?.cleanup()
})

/** Events until `done` says enough (or `ms` passed). */
async function collect(
  it: AsyncGenerator<FileEvent>,
  done: (got: FileEvent[]) => boolean,
  ms = 10_000,
): Promise<FileEvent[]> {
  const got: FileEvent[] = []
  const deadline = Date.now() + ms
  while (!done(got) && Date.now() < deadline) {
    const n = await it.next()
    if (n.done) break
    got.push(n.value)
  }
  return got
}

describe('sandbox provider', () => {
  test('create, resume, destroy; a new sandbox shows the head and nothing uncaptured', async () => {
    const thread = 'sb-life'
    const box = await sandboxes.create(thread)
    expect(box.outcome).toBe('created')
    expect(box.base).toBeNull()
    expect(box.threadId).toBe(thread)
    writeFileSync(join(box.path, 'kept.txt'), 'published')
    const w = await store.acquireWriter(thread)
    const cp = await store.append({
      checkpoint: { threadId: thread, sandbox: box },
      expectedHeadId: null,
      writer: w,
    })
    await w.release()
    writeFileSync(join(box.path, 'uncaptured.txt'), 'never published')

    // Resumed alive: as left, uncaptured work and all.
    const again = await sandboxes.resume(thread)
    expect(again.outcome).toBe('resumed')
    expect(again.key).toBe(box.key)
    expect(again.base).toBe(cp.checkpoint.id)
    expect(existsSync(join(again.path, 'uncaptured.txt'))).toBe(true)
    expect((await sandboxes.list()).map((x) => x.key)).toContain(box.key)

    expect(await box.destroy()).toBe(true)
    expect(await sandboxes.destroy(box.key)).toBe(false)
    expect((await sandboxes.list()).map((x) => x.key)).not.toContain(box.key)

    // Made again: the head's files, not what the destroyed sandbox never published.
    const fresh = await sandboxes.create(thread)
    expect(fresh.outcome).toBe('created')
    expect(fresh.base).toBe(cp.checkpoint.id)
    expect(readFileSync(join(fresh.path, 'kept.txt'), 'utf8')).toBe('published')
    expect(existsSync(join(fresh.path, 'uncaptured.txt'))).toBe(false)
    await fresh.destroy()
  })

  test('a live sandbox behind the head is brought to the head', async () => {
    const thread = 'sb-behind'
    const tenantA = await sandboxes.create(thread, { tenant: 'host-a' })
    const tenantB = await sandboxes.create(thread, { tenant: 'host-b' })
    expect(tenantA.key).not.toBe(tenantB.key)
    writeFileSync(join(tenantA.path, 'from-a.txt'), 'a')
    const w = await store.acquireWriter(thread)
    const cp = await store.append({
      checkpoint: { threadId: thread, sandbox: tenantA },
      expectedHeadId: null,
      writer: w,
    })
    // B still shows the empty thread: publishing from it is a head mismatch...
    writeFileSync(join(tenantB.path, 'from-b.txt'), 'b')
    expect(
      (
        (await store
          .append({ checkpoint: { threadId: thread, sandbox: tenantB }, expectedHeadId: cp.checkpoint.id, writer: w })
          .catch((e: unknown) => e)) as { code: string }
      ).code,
    ).toBe('SANDBOX_SNAPSHOT_HEAD_MISMATCH')
    await w.release()
    // ...and resuming it shows the head (its unpublished file is not the thread's).
    const b2 = await sandboxes.resume(thread, { tenant: 'host-b' })
    expect(b2.outcome).toBe('resumed')
    expect(b2.restored).toBe(true)
    expect(b2.base).toBe(cp.checkpoint.id)
    expect(readFileSync(join(b2.path, 'from-a.txt'), 'utf8')).toBe('a')
    expect(existsSync(join(b2.path, 'from-b.txt'))).toBe(false)
    await tenantA.destroy()
    await tenantB.destroy()
  })

  test('file events arrive in order through the async iterator', async () => {
    const box = await sandboxes.create('sb-events')
    const ac = new AbortController()
    const it = box.events({ waitMs: 2000, signal: ac.signal })
    mkdirSync(join(box.path, 'dir with space'))
    writeFileSync(join(box.path, 'dir with space', 'ünï.txt'), 'x')
    writeFileSync(join(box.path, 'b.txt'), 'b')
    renameSync(join(box.path, 'b.txt'), join(box.path, 'c.txt'))
    rmSync(join(box.path, 'c.txt'))
    const got = await collect(it, (g) =>
      g.some((e) => e.kind === 'delete' && 'path' in e && e.path.endsWith('c.txt')),
    )
    const changes = got.filter((e) => e.kind !== 'lost') as Array<{ seq: number; kind: string; path: string }>
    // Numbered without gaps, in order.
    changes.forEach((e, i) => expect(e.seq).toBe(changes[0]!.seq + i))
    const paths = changes.map((e) => `${e.kind} ${e.path}`)
    expect(paths).toContain('create dir with space')
    expect(paths.some((p) => p.endsWith('dir with space/ünï.txt'))).toBe(true)
    expect(paths.some((p) => p.startsWith('delete') && p.endsWith('c.txt'))).toBe(true)
    // Aborting ends the iteration, also while a request waits.
    const pending = it.next()
    ac.abort()
    expect((await pending).done).toBe(true)
    // A destroyed sandbox's events end (the sandbox is gone), they do not throw.
    const it2 = box.events({ waitMs: 200 })
    await box.destroy()
    expect((await it2.next()).done).toBe(true)
  })

  test('bad input is refused with a named error', async () => {
    const e = await sandboxes.create('bad/thread').catch((x: unknown) => x)
    expect(e).toBeInstanceOf(CasfsError)
    expect((e as CasfsError).kind).toBe('invalid')
    expect((e as CasfsError).message).toContain('bad/thread')
    const t = await sandboxes.create('ok-thread', { tenant: '' }).catch((x: unknown) => x)
    expect((t as CasfsError).kind).toBe('invalid')
    // Events of a sandbox the API never made.
    const { response } = await s.client.api.GET('/v1/sandboxes/{key}/events', {
      params: { path: { key: '../../etc' }, query: {} },
    })
    expect(response.status).toBe(404)
  })
})
