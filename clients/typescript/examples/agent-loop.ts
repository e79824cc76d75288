// Two agent runs on one conversation thread through casfs, the way TanStack AI's
// sandbox middleware drives a provider with `lifecycle: { snapshot: 'after-run' }`:
// each run finds its sandbox (resumed alive, else restored from the thread's latest
// snapshot, else created), works in it, and ends with a native snapshot recorded in the
// instance store. Between the runs the sandbox is destroyed (as when its VM goes away):
// the second run's sandbox is a mount of the first run's snapshot. Run: `npm run
// example` (CASFS_BIN names the casfs binary; default: `casfs` on PATH).
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import {
  CasfsInstanceStore,
  casfsSandbox,
  startCasfsServe,
  type SandboxHandle,
} from '../src/index.js'

const dir = mkdtempSync(join(tmpdir(), 'casfs-agent-loop-'))
const served = await startCasfsServe({ bin: process.env.CASFS_BIN ?? 'casfs', store: join(dir, 'store') })
const provider = casfsSandbox({ client: served.client })
const instances = new CasfsInstanceStore({ client: served.client, store: 'agent-loop' })
const thread = 'conversation-42'

const ms = (since: number): string => `${(performance.now() - since).toFixed(1)} ms`

/** The thread's sandbox, as the middleware's ensure() finds it. */
async function ensure(): Promise<{ handle: SandboxHandle; outcome: string }> {
  const record = await instances.get(thread)
  const live = record && (await provider.resume({ id: record.providerSandboxId }))
  if (live) return { handle: live, outcome: 'resumed' }
  if (record?.latestSnapshotId && provider.restoreSnapshot) {
    const handle = await provider.restoreSnapshot({ snapshotId: record.latestSnapshotId })
    return { handle, outcome: `restored ${record.latestSnapshotId.slice(0, 12)}` }
  }
  return { handle: await provider.create({ id: thread }), outcome: 'created' }
}

async function run(runId: string, work: (h: SandboxHandle) => Promise<void>): Promise<SandboxHandle> {
  let t = performance.now()
  const { handle, outcome } = await ensure()
  console.log(`${runId}: sandbox ${outcome} in ${ms(t)}`)
  await work(handle)
  t = performance.now()
  const snap = await handle.snapshot!(`after-${runId}`)
  await instances.upsert({
    key: thread,
    provider: provider.name,
    providerSandboxId: handle.id,
    latestSnapshotId: snap.id,
    threadId: thread,
    latestRunId: runId,
    updatedAt: Date.now(),
  })
  console.log(`${runId}: snapshot ${snap.id.slice(0, 12)} in ${ms(t)}`)
  return handle
}

try {
  const first = await run('run-1', async (h) => {
    await h.fs.write('/workspace/plan.md', '# plan\n- step one\n')
    const r = await h.process.exec('mkdir -p src && echo "print(1)" > src/main.py && ls src')
    console.log(`run-1: the shell made ${r.stdout.trim()}`)
  })
  // The sandbox goes away between runs.
  await provider.destroy({ id: first.id })
  await run('run-2', async (h) => {
    const plan = await h.fs.read('/workspace/plan.md')
    console.log(`run-2: resumed plan.md from run-1: ${JSON.stringify(plan.split('\n')[1])}`)
    await h.fs.write('/workspace/plan.md', `${plan}- step two\n`)
  })
  const record = await instances.get(thread)
  console.log(`latest: ${record?.latestSnapshotId?.slice(0, 12)} (after ${record?.latestRunId})`)
} finally {
  await served.stop()
  rmSync(dir, { recursive: true, force: true })
}
