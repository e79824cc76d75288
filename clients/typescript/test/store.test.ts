// The checkpoint store adapter against a real `casfs serve`: every method, the lease
// race, a stale head, an expired and a taken-over lease, and the codes a framework
// checks.
import { readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'

import { afterAll, beforeAll, describe, expect, test } from 'vitest'

import {
  CasfsCheckpointStore,
  CasfsError,
  CasfsSandboxProvider,
  SandboxCheckpointError,
} from '../src/index.js'
import { codeOf, serve, sleep } from './helpers.js'

let s: Awaited<ReturnType<typeof serve>>
let store: CasfsCheckpointStore
let sandboxes: CasfsSandboxProvider

beforeAll(async () => {
  s = await serve({ args: ['--lease-ttl', '5', '--secret', 'CASFS_TS_SECRET'], env: {
    ...process.env,
    CASFS_TS_SECRET: 'sk-live-4f9a8b7c6d5e',
  } })
  store = new CasfsCheckpointStore(s.client)
  sandboxes = new CasfsSandboxProvider(s.client)
})

afterAll(async () => {
  await s?.cleanup()
})

describe('checkpoint store', () => {
  test('acquire, renew, append, getHead, get, log, release', async () => {
    const thread = 'store-basic'
    expect(await store.getHead(thread)).toBeNull()
    const writer = await store.acquireWriter(thread, { holder: 'test writer one' })
    expect(writer.threadId).toBe(thread)
    expect(writer.holder).toBe('test writer one')
    expect(writer.token).toBeGreaterThan(0)
    // A third of the server's 5 s TTL.
    expect(writer.renewAfterMs).toBe(1666)
    const firstExpiry = writer.expiresAt
    await sleep(20)
    await writer.renew()
    expect(writer.expiresAt).toBeGreaterThan(firstExpiry)
    expect(writer.held).toBe(true)

    const box = await sandboxes.create(thread)
    writeFileSync(join(box.path, 'notes.md'), '# run one\n')
    const head = await store.getHead(thread)
    const first = await store.append({
      checkpoint: {
        threadId: thread,
        sandbox: box,
        reason: 'after run one',
        sourceRunId: 'run-1',
        conversation: [{ role: 'user', content: 'write notes' }],
      },
      expectedHeadId: head,
      writer,
    })
    expect(first.checkpoint.parent_id).toBeNull()
    expect(first.checkpoint.thread_id).toBe(thread)
    expect(first.checkpoint.reason).toBe('after run one')
    expect(first.checkpoint.source_run_id).toBe('run-1')
    expect(first.checkpoint.conversation?.size).toBeGreaterThan(0)
    expect(first.changedFiles).toBe(1)
    expect(await store.getHead(thread)).toBe(first.checkpoint.id)

    writeFileSync(join(box.path, 'notes.md'), '# run one\nmore\n')
    const second = await store.append({
      checkpoint: { threadId: thread, sandbox: box.key },
      expectedHeadId: first.checkpoint.id,
      writer,
    })
    expect(second.checkpoint.parent_id).toBe(first.checkpoint.id)

    const got = await store.get(second.checkpoint.id)
    expect(got?.id).toBe(second.checkpoint.id)
    expect(got?.root).toBe(second.checkpoint.root)
    const log = await store.log(thread)
    expect(log.map((c) => c.id)).toEqual([second.checkpoint.id, first.checkpoint.id])

    await writer.release()
    expect(writer.held).toBe(false)
    // Released: the adapter refuses to publish or renew, and a second release is a no-op.
    expect(await codeOf(writer.renew())).toBe('SANDBOX_SNAPSHOT_LEASE_LOST')
    expect(
      await codeOf(
        store.append({
          checkpoint: { threadId: thread, sandbox: box },
          expectedHeadId: second.checkpoint.id,
          writer,
        }),
      ),
    ).toBe('SANDBOX_SNAPSHOT_LEASE_LOST')
    await writer.release()
    // The thread is free again, with a larger fencing token.
    const next = await store.acquireWriter(thread)
    expect(next.token).toBeGreaterThan(writer.token)
    await next.release()
    await box.destroy()
  })

  test('two writers race for one thread: exactly one wins', async () => {
    const thread = 'store-race'
    const tries = await Promise.allSettled(
      Array.from({ length: 6 }, (_, i) => store.acquireWriter(thread, { holder: `racer ${i}` })),
    )
    const won = tries.filter((t) => t.status === 'fulfilled')
    const lost = tries.filter((t) => t.status === 'rejected')
    expect(won).toHaveLength(1)
    expect(lost).toHaveLength(5)
    for (const l of lost) {
      const e = (l as PromiseRejectedResult).reason
      expect(e).toBeInstanceOf(SandboxCheckpointError)
      expect(e.code).toBe('SANDBOX_SNAPSHOT_LEASE_HELD')
      // The refusal names the holder.
      expect(e.message).toContain('racer')
      expect((e.cause as CasfsError).status).toBe(409)
    }
    await (won[0] as PromiseFulfilledResult<Awaited<ReturnType<typeof store.acquireWriter>>>).value.release()
  })

  test('a stale expectedHeadId is refused and nothing is published', async () => {
    const thread = 'store-stale'
    const box = await sandboxes.create(thread)
    const w = await store.acquireWriter(thread)
    writeFileSync(join(box.path, 'a.txt'), 'one')
    const a = await store.append({
      checkpoint: { threadId: thread, sandbox: box },
      expectedHeadId: null,
      writer: w,
    })
    writeFileSync(join(box.path, 'a.txt'), 'two')
    // The writer read the head before `a` was published: refused.
    const e = await store
      .append({ checkpoint: { threadId: thread, sandbox: box }, expectedHeadId: null, writer: w })
      .catch((x: unknown) => x)
    expect(e).toBeInstanceOf(SandboxCheckpointError)
    expect((e as SandboxCheckpointError).code).toBe('SANDBOX_SNAPSHOT_HEAD_MISMATCH')
    expect((e as Error).message).toContain(a.checkpoint.id.slice(0, 12))
    // A full id is required: a prefix is not a compare-and-swap.
    expect(
      await codeOf(
        store.append({
          checkpoint: { threadId: thread, sandbox: box },
          expectedHeadId: a.checkpoint.id.slice(0, 12),
          writer: w,
        }),
      ),
    ).toBe('SANDBOX_SNAPSHOT_STORE_ERROR')
    expect(await store.getHead(thread)).toBe(a.checkpoint.id)
    // The refused change is still in the workspace: it can be published on the head.
    expect(readFileSync(join(box.path, 'a.txt'), 'utf8')).toBe('two')
    const b = await store.append({
      checkpoint: { threadId: thread, sandbox: box },
      expectedHeadId: a.checkpoint.id,
      writer: w,
    })
    expect(b.checkpoint.parent_id).toBe(a.checkpoint.id)
    await w.release()
    await box.destroy()
  })

  test('an expired lease is refused; a writer that took over holds the thread', async () => {
    const thread = 'store-expired'
    const box = await sandboxes.create(thread)
    const old = await store.acquireWriter(thread, { holder: 'stalled writer', ttlMs: 300 })
    writeFileSync(join(box.path, 'x.txt'), 'stalled')
    await sleep(500)
    // Expired, nobody took it yet: the store refuses the append (lease_expired).
    const e = await store
      .append({ checkpoint: { threadId: thread, sandbox: box }, expectedHeadId: null, writer: old })
      .catch((x: unknown) => x)
    expect((e as SandboxCheckpointError).code).toBe('SANDBOX_SNAPSHOT_LEASE_LOST')
    expect(((e as SandboxCheckpointError).cause as CasfsError).kind).toBe('lease_expired')
    expect(await store.getHead(thread)).toBeNull()

    // Another writer takes the thread over; the stalled one's renewal fails for good.
    const fresh = await store.acquireWriter(thread, { holder: 'fresh writer' })
    expect(fresh.token).toBeGreaterThan(old.token)
    const r = await old.renew().catch((x: unknown) => x)
    expect((r as SandboxCheckpointError).code).toBe('SANDBOX_SNAPSHOT_LEASE_LOST')
    expect(old.held).toBe(false)
    expect(old.lost).toBe(r)
    // Releasing a lost lease is not an error (there is nothing to give up) and leaves
    // the new writer's lease alone.
    await old.release()
    const pub = await store.append({
      checkpoint: { threadId: thread, sandbox: box },
      expectedHeadId: null,
      writer: fresh,
    })
    expect(await store.getHead(thread)).toBe(pub.checkpoint.id)

    // The old writer's lease record, replayed by hand past the adapter's own refusal:
    // the server refuses the stale fencing token (lease_lost).
    const { error, response } = await s.client.api.POST('/v1/threads/{thread}/checkpoints', {
      params: { path: { thread } },
      body: { sandbox: box.key, expected_head: pub.checkpoint.id, writer: old.proof },
    })
    expect(response.status).toBe(409)
    expect((error as { error: { kind: string } }).error.kind).toBe('lease_lost')
    await fresh.release()
    await box.destroy()
  })

  test('keepAlive renews past the TTL', async () => {
    const thread = 'store-keepalive'
    const w = await store.acquireWriter(thread, { ttlMs: 600 })
    const lost: unknown[] = []
    const stop = w.keepAlive((e) => lost.push(e))
    await sleep(1500)
    expect(lost).toEqual([])
    expect(w.held).toBe(true)
    // Still the thread's writer: nobody else can take it.
    expect(await codeOf(store.acquireWriter(thread))).toBe('SANDBOX_SNAPSHOT_LEASE_HELD')
    stop()
    await w.release()
  })

  test('error codes and kinds', async () => {
    // A checkpoint that does not exist: null, as the framework expects.
    expect(await store.get('f'.repeat(64))).toBeNull()
    // A bad thread name: the server's `invalid`, named.
    const bad = await store.acquireWriter('has space').catch((x: unknown) => x)
    expect(bad).toBeInstanceOf(SandboxCheckpointError)
    const cause = (bad as SandboxCheckpointError).cause as CasfsError
    expect(cause).toBeInstanceOf(CasfsError)
    expect(cause.kind).toBe('invalid')
    expect(cause.status).toBe(400)
    expect(cause.message).toContain('has space')
    // A TTL beyond what the store gives.
    expect(await codeOf(store.acquireWriter('ttl-thread', { ttlMs: 10 }))).toBe(
      'SANDBOX_SNAPSHOT_STORE_ERROR',
    )
    // A holder name holding a secret's value is never stored.
    const secret = await store
      .acquireWriter('secret-thread', { holder: 'me sk-live-4f9a8b7c6d5e' })
      .catch((x: unknown) => x)
    expect(((secret as SandboxCheckpointError).cause as CasfsError).kind).toBe('invalid')
    expect((secret as Error).message).not.toContain('sk-live-4f9a8b7c6d5e')
    // Appending a sandbox of another thread.
    const other = await sandboxes.create('thread-a')
    const w = await store.acquireWriter('thread-b')
    const wrong = await store
      .append({ checkpoint: { threadId: 'thread-b', sandbox: other }, expectedHeadId: null, writer: w })
      .catch((x: unknown) => x)
    expect(((wrong as SandboxCheckpointError).cause as CasfsError).kind).toBe('wrong_thread')
    // A sandbox that does not exist.
    const none = await store
      .append({ checkpoint: { threadId: 'thread-b', sandbox: 'no-such' }, expectedHeadId: null, writer: w })
      .catch((x: unknown) => x)
    expect(((none as SandboxCheckpointError).cause as CasfsError).kind).toBe('not_found')
    // A lease of one thread for another thread's checkpoint.
    expect(
      await codeOf(
        store.append({ checkpoint: { threadId: 'thread-a', sandbox: other }, expectedHeadId: null, writer: w }),
      ),
    ).toBe('SANDBOX_SNAPSHOT_STORE_ERROR')
    expect(await store.getHead('thread-b')).toBeNull()
    await w.release()
    await other.destroy()
  })

  test('thread names that need escaping in a URL', async () => {
    for (const thread of ['a?b#c', 'pct%2Fnot-a-slash', 'ünïcødé-✓', 'a:b@c+d&e=f']) {
      const box = await sandboxes.create(thread)
      const w = await store.acquireWriter(thread)
      writeFileSync(join(box.path, 'f'), thread)
      const r = await store.append({
        checkpoint: { threadId: thread, sandbox: box },
        expectedHeadId: await store.getHead(thread),
        writer: w,
      })
      expect(r.checkpoint.thread_id).toBe(thread)
      expect(await store.getHead(thread)).toBe(r.checkpoint.id)
      await w.release()
      await box.destroy()
    }
  })
})
