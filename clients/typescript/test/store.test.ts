// The framework's checkpoint, transcript and instance stores on a real `casfs serve`:
// every rule of the SandboxCheckpointStore contract (compare-and-swap, duplicate ids,
// the check order, UTF-8 ordering, blob references, non-waiting leases judged by an
// injected clock, stale writers after a takeover, forks), each store in a name of its
// own, and what survives a server restart.
import { randomUUID } from 'node:crypto'

import { afterAll, beforeAll, describe, expect, test } from 'vitest'

import {
  CasfsCheckpointStore,
  type CasfsCheckpointStoreOptions,
  CasfsInstanceStore,
  casfsSnapshotStores,
  type SandboxCheckpoint,
  type SandboxCheckpointStore,
  type SandboxCheckpointWriterLease,
} from '../src/index.js'
import { codeOf, serve } from './helpers.js'

let s: Awaited<ReturnType<typeof serve>>
beforeAll(async () => {
  s = await serve({ args: ['--allow-client-clocks'] })
})
afterAll(async () => {
  await s?.cleanup()
})

function blob(n: number | string, kind: 'files' | 'artifacts' = 'files'): string {
  const hex = String(n).replace(/[^0-9a-f]/g, '').padStart(64, '0').slice(-64)
  return `sandbox-${kind}/sha256/${hex}`
}

function cp(
  id: string,
  parent: string | null,
  extra: Partial<SandboxCheckpoint> = {},
): SandboxCheckpoint {
  return {
    id,
    threadId: 'thread-a',
    parentCheckpointId: parent,
    createdAt: 10,
    reason: 'automatic',
    files: [{ path: `${id.length}.txt`, kind: 'file', blobKey: blob(id.length + 1), size: 1 }],
    conversation: [{ role: 'user', content: `message ${id}` }],
    artifacts: [],
    ...extra,
  }
}

function store(
  options: Omit<CasfsCheckpointStoreOptions, 'client' | 'store'> = {},
): CasfsCheckpointStore {
  return new CasfsCheckpointStore({ client: s.client, store: `t-${randomUUID()}`, ...options })
}

async function writer(st: SandboxCheckpointStore, thread = 'thread-a'): Promise<SandboxCheckpointWriterLease> {
  return st.acquireWriter(thread)
}

describe('checkpoint store', () => {
  test('an empty store knows nothing', async () => {
    const st = store()
    expect(await st.get('nope')).toBeNull()
    expect(await st.getHead('thread-a')).toBeNull()
    expect(await st.list('thread-a')).toEqual([])
    expect(await st.listBlobReferences()).toEqual([])
  })

  test('appends chain by parent and read back exactly', async () => {
    const st = store()
    const w = await writer(st)
    const root = cp('root', null, { label: 'first', sourceRunId: 'run-1' })
    expect(await st.append({ checkpoint: root, expectedHeadId: null, writer: w })).toEqual({
      headId: 'root',
    })
    const child = cp('child', 'root', { createdAt: 11, reason: 'named' })
    expect(await st.append({ checkpoint: child, expectedHeadId: 'root', writer: w })).toEqual({
      headId: 'child',
    })
    expect(await st.getHead('thread-a')).toBe('child')
    expect(await st.get('root')).toEqual(root)
    const got = await st.get('child')
    expect(got).toEqual(child)
    expect(got).not.toHaveProperty('label')
    // A parent left out is stored as null.
    const st2 = store()
    const w2 = await writer(st2)
    const noParent = cp('x', null)
    delete (noParent as Partial<SandboxCheckpoint>).parentCheckpointId
    await st2.append({ checkpoint: noParent, expectedHeadId: null, writer: w2 })
    expect((await st2.get('x'))?.parentCheckpointId).toBeNull()
  })

  test('compare-and-swap on the head, then on the parent', async () => {
    const st = store()
    const w = await writer(st)
    await st.append({ checkpoint: cp('a', null), expectedHeadId: null, writer: w })
    expect(await codeOf(st.append({ checkpoint: cp('b', null), expectedHeadId: null, writer: w }))).toBe(
      'SANDBOX_SNAPSHOT_STALE_HEAD',
    )
    expect(await codeOf(st.append({ checkpoint: cp('b', null), expectedHeadId: 'a', writer: w }))).toBe(
      'SANDBOX_SNAPSHOT_PARENT_MISMATCH',
    )
    expect(await st.getHead('thread-a')).toBe('a')
  })

  test('a taken id is refused before the head is looked at', async () => {
    const st = store()
    const w = await writer(st)
    await st.append({ checkpoint: cp('a', null), expectedHeadId: null, writer: w })
    // Both a stale head and a wrong parent here: the duplicate wins.
    expect(await codeOf(st.append({ checkpoint: cp('a', 'zz'), expectedHeadId: 'zz', writer: w }))).toBe(
      'SANDBOX_SNAPSHOT_DUPLICATE_ID',
    )
  })

  test('threads are kept apart', async () => {
    const st = store()
    const wa = await writer(st, 'thread-a')
    const wb = await writer(st, 'thread-b')
    await st.append({ checkpoint: cp('a1', null), expectedHeadId: null, writer: wa })
    await st.append({
      checkpoint: { ...cp('b1', null), threadId: 'thread-b' },
      expectedHeadId: null,
      writer: wb,
    })
    expect((await st.list('thread-a')).map((c) => c.id)).toEqual(['a1'])
    expect((await st.list('thread-b')).map((c) => c.id)).toEqual(['b1'])
    // A writer of one thread does not append to another.
    expect(
      await codeOf(
        st.append({ checkpoint: cp('a2', 'a1'), expectedHeadId: 'a1', writer: wb }),
      ),
    ).toBe('SANDBOX_SNAPSHOT_WRITER_LOST')
  })

  test('lists by createdAt, then by id as UTF-8 bytes; blob keys likewise', async () => {
    const st = store()
    const w = await writer(st)
    const ids = ['é', 'a', 'B', '😀', 'b']
    let head: string | null = null
    for (const [i, id] of ids.entries()) {
      const c = cp(id, head, {
        createdAt: id === 'b' ? 5 : 20,
        files: [{ path: `f${i}`, kind: 'file', blobKey: blob(100 - i), size: i }],
      })
      head = (await st.append({ checkpoint: c, expectedHeadId: head, writer: w })).headId
    }
    expect((await st.list('thread-a')).map((c) => c.id)).toEqual(['b', 'B', 'a', 'é', '😀'])
    const refs = await st.listBlobReferences()
    expect(refs.map((r) => r.key)).toEqual([...refs.map((r) => r.key)].sort())
    expect(refs).toHaveLength(5)
  })

  test('ids and entries that break the rules are refused, changing nothing', async () => {
    const st = store()
    const w = await writer(st)
    expect(await codeOf(st.get(''))).toBe('SANDBOX_SNAPSHOT_INVALID_ID')
    expect(await codeOf(st.get('\uD800'))).toBe('SANDBOX_SNAPSHOT_INVALID_ID')
    expect(
      await codeOf(st.append({ checkpoint: cp('\uDC00x', null), expectedHeadId: null, writer: w })),
    ).toBe('SANDBOX_SNAPSHOT_INVALID_ID')
    for (const createdAt of [Number.NaN, Infinity, -Infinity]) {
      expect(
        await codeOf(st.append({ checkpoint: cp('t', null, { createdAt }), expectedHeadId: null, writer: w })),
      ).toBe('SANDBOX_SNAPSHOT_INVALID_ENTRY')
    }
    const badFiles: SandboxCheckpoint['files'][] = [
      [{ path: '/abs', kind: 'file', blobKey: blob(1), size: 1 }],
      [{ path: 'a/../b', kind: 'file', blobKey: blob(1), size: 1 }],
      [{ path: 'a', kind: 'file', blobKey: `${blob(1)}\uD800`, size: 1 }],
      [{ path: 'a', kind: 'file', blobKey: 'sandbox-files/sha256/xyz', size: 1 }],
      [{ path: 'a', kind: 'file', blobKey: blob(1), size: -1 }],
      [{ path: 'a', kind: 'file', blobKey: blob(1), size: 1 }, { path: 'a/b', kind: 'dir' }],
      [{ path: 'a', kind: 'dir', size: 0 } as never],
    ]
    for (const files of badFiles) {
      expect(
        await codeOf(st.append({ checkpoint: cp('t', null, { files }), expectedHeadId: null, writer: w })),
      ).toBe('SANDBOX_SNAPSHOT_INVALID_ENTRY')
    }
    const badArtifact = {
      artifactId: 'a',
      name: 'n',
      mimeType: 'text/plain',
      size: 1,
      blobKey: blob(1), // a files key, not an artifacts one
      createdAt: 1,
    }
    expect(
      await codeOf(
        st.append({ checkpoint: cp('t', null, { artifacts: [badArtifact] }), expectedHeadId: null, writer: w }),
      ),
    ).toBe('SANDBOX_SNAPSHOT_INVALID_ENTRY')
    expect(await st.getHead('thread-a')).toBeNull()
    expect(await st.listBlobReferences()).toEqual([])
  })

  test('records are copies; a blob key counts once per checkpoint', async () => {
    const st = store()
    const w = await writer(st)
    const shared = blob(7)
    const c = cp('one', null, {
      files: [
        { path: 'a', kind: 'file', blobKey: shared, size: 1 },
        { path: 'b', kind: 'file', blobKey: shared, size: 1 },
        { path: 'd', kind: 'dir' },
      ],
      artifacts: [
        { artifactId: 'r', name: 'r.txt', mimeType: 'text/plain', size: 2, blobKey: blob(8, 'artifacts'), createdAt: 3 },
      ],
    })
    await st.append({ checkpoint: c, expectedHeadId: null, writer: w })
    ;(c.files as unknown[]).length = 0
    const got = await st.get('one')
    expect(got?.files).toHaveLength(3)
    ;(got?.conversation as unknown[]).push({ role: 'x' })
    expect((await st.get('one'))?.conversation).toHaveLength(1)
    expect(await st.listBlobReferences()).toEqual([
      { key: blob(8, 'artifacts'), references: 1 },
      { key: shared, references: 1 },
    ])
    await st.append({
      checkpoint: cp('two', 'one', { files: [{ path: 'a', kind: 'file', blobKey: shared, size: 1 }] }),
      expectedHeadId: 'one',
      writer: w,
    })
    expect((await st.listBlobReferences()).find((r) => r.key === shared)?.references).toBe(2)
    await st.deleteHead({ threadId: 'thread-a', checkpointId: 'two', writer: w })
    expect((await st.listBlobReferences()).find((r) => r.key === shared)?.references).toBe(1)
  })

  test('deleteHead removes only the head and moves it to the parent', async () => {
    const st = store()
    const w = await writer(st)
    await st.append({ checkpoint: cp('p', null), expectedHeadId: null, writer: w })
    await st.append({ checkpoint: cp('q', 'p'), expectedHeadId: 'p', writer: w })
    expect(await codeOf(st.deleteHead({ threadId: 'thread-a', checkpointId: 'p', writer: w }))).toBe(
      'SANDBOX_SNAPSHOT_NOT_HEAD',
    )
    await st.deleteHead({ threadId: 'thread-a', checkpointId: 'q', writer: w })
    expect(await st.getHead('thread-a')).toBe('p')
    expect(await st.get('q')).toBeNull()
    await st.deleteHead({ threadId: 'thread-a', checkpointId: 'p', writer: w })
    expect(await st.getHead('thread-a')).toBeNull()
    expect(await st.listBlobReferences()).toEqual([])
  })

  test('one writer per thread, never waiting; the fence grows past releases', async () => {
    const st = store()
    const first = await st.acquireWriter('thread-a')
    expect(await codeOf(st.acquireWriter('thread-a'))).toBe('SANDBOX_SNAPSHOT_WRITER_CONFLICT')
    const other = await st.acquireWriter('thread-b')
    expect(other.fence).toBe(1)
    await first.release()
    const second = await st.acquireWriter('thread-a')
    expect(second.fence).toBeGreaterThan(first.fence)
    expect(second.ownerToken).not.toBe(first.ownerToken)
    // A hand-made writer with the right fence but no secret is nobody.
    const forged = { threadId: 'thread-a', ownerToken: 'guess', fence: second.fence }
    expect(await codeOf(st.append({ checkpoint: cp('f', null), expectedHeadId: null, writer: forged }))).toBe(
      'SANDBOX_SNAPSHOT_WRITER_LOST',
    )
    // The first writer's release changes nothing now.
    await first.release()
    expect(await codeOf(st.acquireWriter('thread-a'))).toBe('SANDBOX_SNAPSHOT_WRITER_CONFLICT')
  })

  test('an injected clock decides expiry, renewal and takeover', async () => {
    let now = 1_000_000
    const st = store({ now: () => now, leaseDurationMs: 1000, renewAfterMs: 300 })
    const old = await st.acquireWriter('thread-a')
    expect(old.expiresAt).toBe(now + 1000)
    now += old.renewAfterMs
    expect(await old.renew()).toEqual({ expiresAt: now + 1000 })
    expect(old.expiresAt).toBe(now + 1000)
    await st.append({ checkpoint: cp('a', null), expectedHeadId: null, writer: old })
    // Past its expiry by the clock (no real time passed): another writer takes over.
    now += 1001
    expect(await codeOf(old.renew())).toBe('SANDBOX_SNAPSHOT_WRITER_LOST')
    expect(await codeOf(st.append({ checkpoint: cp('b', 'a'), expectedHeadId: 'a', writer: old }))).toBe(
      'SANDBOX_SNAPSHOT_WRITER_LOST',
    )
    expect(await codeOf(st.deleteHead({ threadId: 'thread-a', checkpointId: 'a', writer: old }))).toBe(
      'SANDBOX_SNAPSHOT_WRITER_LOST',
    )
    const next = await st.acquireWriter('thread-a')
    expect(next.fence).toBeGreaterThan(old.fence)
    await old.release()
    expect(await codeOf(st.acquireWriter('thread-a'))).toBe('SANDBOX_SNAPSHOT_WRITER_CONFLICT')
    expect(await codeOf(old.renew())).toBe('SANDBOX_SNAPSHOT_WRITER_LOST')
    expect(await st.getHead('thread-a')).toBe('a')
  })

  test('a store on the server clock refuses a stated time, and bad lease settings', async () => {
    const st = store()
    await st.getHead('x')
    const { error, response } = await s.client.api.POST('/v1/stores/{store}/writers', {
      params: { path: { store: st.storeName } },
      body: { thread_id: 'z', now: 5 },
    })
    expect(response.status).toBe(400)
    expect((error as { error: { kind: string } }).error.kind).toBe('invalid')
    expect(() => store({ leaseDurationMs: 0 })).toThrow(/leaseDurationMs/)
    expect(() => store({ leaseDurationMs: 100, renewAfterMs: 100 })).toThrow(/renewAfterMs/)
    // The same name made with other settings is refused.
    const name = `t-${randomUUID()}`
    const a = new CasfsCheckpointStore({ client: s.client, store: name, leaseDurationMs: 5000, renewAfterMs: 1000 })
    await a.acquireWriter('x')
    const b = new CasfsCheckpointStore({ client: s.client, store: name })
    const e = (await b.acquireWriter('y').catch((x: unknown) => x)) as { kind?: string }
    expect(e.kind).toBe('store_exists')
  })
})

describe('fork', () => {
  async function setup() {
    const st = casfsSnapshotStores({ client: s.client, store: `t-${randomUUID()}` })
    const w = await st.checkpoints.acquireWriter('source')
    const root = { ...cp('src-root', null), threadId: 'source', label: 'L', sourceRunId: 'r' }
    await st.checkpoints.append({ checkpoint: root, expectedHeadId: null, writer: w })
    const next = { ...cp('src-next', 'src-root'), threadId: 'source', conversation: [{ role: 'user' as const, content: 'later' }] }
    await st.checkpoints.append({ checkpoint: next, expectedHeadId: 'src-root', writer: w })
    await st.messages.saveThread('source', [{ role: 'user', content: 'the live transcript' }])
    return { st, root }
  }

  test('a historical checkpoint becomes the root of a new thread, with its transcript', async () => {
    const { st, root } = await setup()
    const dw = await st.checkpoints.acquireWriter('destination')
    const { checkpoint } = await st.checkpoints.forkFromCheckpoint({
      sourceThreadId: 'source',
      sourceCheckpointId: 'src-root',
      destinationThreadId: 'destination',
      destinationCheckpointId: 'fork-root',
      createdAt: 20,
      writer: dw,
    })
    expect(checkpoint).toEqual({
      id: 'fork-root',
      threadId: 'destination',
      parentCheckpointId: null,
      createdAt: 20,
      reason: 'fork-root',
      files: root.files,
      conversation: root.conversation,
      artifacts: [],
    })
    expect(await st.messages.loadThread('destination')).toEqual(root.conversation)
    expect(await st.checkpoints.getHead('destination')).toBe('fork-root')
    expect(await st.checkpoints.getHead('source')).toBe('src-next')
  })

  test('every refusal leaves both threads as they were', async () => {
    const { st } = await setup()
    const dw = await st.checkpoints.acquireWriter('destination')
    const before = async () =>
      JSON.stringify([
        await st.messages.loadThread('destination'),
        await st.checkpoints.getHead('destination'),
        await st.checkpoints.list('destination'),
        await st.checkpoints.listBlobReferences(),
      ])
    const start = await before()
    const base = {
      sourceThreadId: 'source',
      sourceCheckpointId: 'src-root',
      destinationThreadId: 'destination',
      destinationCheckpointId: 'fork-root',
      createdAt: 20,
      writer: dw as { threadId: string; ownerToken: string; fence: number },
    }
    const other = await st.checkpoints.acquireWriter('another-thread')
    const released = await st.checkpoints.acquireWriter('released')
    await released.release()
    const cases: Array<[Partial<typeof base>, string]> = [
      [{ sourceCheckpointId: 'missing' }, 'SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND'],
      [{ sourceThreadId: 'elsewhere' }, 'SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH'],
      [{ destinationThreadId: 'source' }, 'SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH'],
      [{ writer: { threadId: 'destination', ownerToken: 'missing-owner', fence: 1 } }, 'SANDBOX_SNAPSHOT_WRITER_LOST'],
      [{ writer: other }, 'SANDBOX_SNAPSHOT_WRITER_LOST'],
      [{ destinationCheckpointId: 'src-next' }, 'SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY'],
      [{ createdAt: Number.NaN }, 'SANDBOX_SNAPSHOT_INVALID_ENTRY'],
    ]
    for (const [change, code] of cases) {
      expect(await codeOf(st.checkpoints.forkFromCheckpoint({ ...base, ...change }))).toBe(code)
      expect(await before()).toBe(start)
    }
    // A destination with a transcript is not empty.
    await st.messages.saveThread('destination', [{ role: 'user', content: 'already here' }])
    expect(await codeOf(st.checkpoints.forkFromCheckpoint(base))).toBe(
      'SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY',
    )
    // A stale destination writer.
    const st2 = await setup()
    const w2 = await st2.st.checkpoints.acquireWriter('destination')
    await w2.release()
    expect(
      await codeOf(st2.st.checkpoints.forkFromCheckpoint({ ...base, writer: w2 })),
    ).toBe('SANDBOX_SNAPSHOT_WRITER_LOST')
  })
})

describe('instance store', () => {
  const record = (extra = {}) => ({
    key: 'thread-1',
    provider: 'casfs',
    providerSandboxId: 'sb-1',
    threadId: 'thread-1',
    updatedAt: 1,
    ...extra,
  })

  test('round-trips, replaces whole, keeps keys apart, deletes', async () => {
    const st = new CasfsInstanceStore({ client: s.client, store: `t-${randomUUID()}` })
    expect(await st.get('absent')).toBeNull()
    const full = record({ latestSnapshotId: 'snap-1', latestRunId: 'run-1' })
    await st.upsert(full)
    expect(await st.get('thread-1')).toEqual(full)
    await st.upsert(record({ updatedAt: 2 }))
    const back = await st.get('thread-1')
    expect(back).toEqual(record({ updatedAt: 2 }))
    expect(back && 'latestSnapshotId' in back).toBe(false)
    await st.upsert(record({ key: 'a', providerSandboxId: 'x' }))
    await st.upsert(record({ key: 'b', providerSandboxId: 'y' }))
    expect((await st.get('a'))?.providerSandboxId).toBe('x')
    expect((await st.get('b'))?.providerSandboxId).toBe('y')
    await st.delete('a')
    expect(await st.get('a')).toBeNull()
    expect(await st.delete('never')).toBeUndefined()
  })
})

describe('durability', () => {
  test('records, heads, leases and instances outlive a server restart', async () => {
    const own = await serve()
    try {
      // Without --allow-client-clocks, no store keeps its clients' time.
      const clocked = new CasfsCheckpointStore({ client: own.client, store: 'c', now: () => 1 })
      const e = (await clocked.getHead('x').catch((x: unknown) => x)) as { kind?: string }
      expect(e.kind).toBe('invalid')
      const name = `t-${randomUUID()}`
      const st = casfsSnapshotStores({ client: own.client, store: name })
      const w = await st.checkpoints.acquireWriter('thread-a')
      await st.checkpoints.append({ checkpoint: cp('kept', null), expectedHeadId: null, writer: w })
      await st.instances.upsert({
        key: 'k', provider: 'casfs', providerSandboxId: 'p', threadId: 'thread-a', updatedAt: 5,
      })
      await own.restart()
      const again = casfsSnapshotStores({ client: own.client, store: name })
      expect(await again.checkpoints.getHead('thread-a')).toBe('kept')
      expect((await again.checkpoints.get('kept'))?.conversation).toEqual(cp('kept', null).conversation)
      expect((await again.instances.get('k'))?.providerSandboxId).toBe('p')
      // The lease is still the first writer's, and still works for it.
      expect(await codeOf(again.checkpoints.acquireWriter('thread-a'))).toBe('SANDBOX_SNAPSHOT_WRITER_CONFLICT')
      await again.checkpoints.append({ checkpoint: cp('after', 'kept'), expectedHeadId: 'kept', writer: w })
      expect(await again.checkpoints.getHead('thread-a')).toBe('after')
    } finally {
      await own.cleanup()
    }
  })
})
