// Two agent runs on one thread through casfs: the second resumes the first's files on
// a sandbox made anew (as after the first run's VM went away), and a third run started
// while the second holds the thread is refused. Run: `npm run example` (CASFS_BIN names
// the casfs binary; default: `casfs` on PATH). Prints what each step took.
import { mkdtempSync, readFileSync, rmSync, writeFileSync, appendFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import {
  CasfsCheckpointStore,
  CasfsSandboxProvider,
  SandboxCheckpointError,
  startCasfsServe,
  type CasfsSandbox,
} from '../src/index.js'

const dir = mkdtempSync(join(tmpdir(), 'casfs-agent-loop-'))
const served = await startCasfsServe({
  bin: process.env.CASFS_BIN ?? 'casfs',
  store: join(dir, 'store'),
  args: ['--lease-ttl', '10'],
})
const checkpoints = new CasfsCheckpointStore(served.client)
const sandboxes = new CasfsSandboxProvider(served.client)
const thread = 'conversation-42'

function ms(since: number): string {
  return `${(performance.now() - since).toFixed(1)} ms`
}

/** One run: take the thread, get its sandbox at the head, work, publish, let go. */
async function run(runId: string, work: (sandbox: CasfsSandbox) => void | Promise<void>) {
  let t = performance.now()
  const writer = await checkpoints.acquireWriter(thread, { holder: `agent-loop ${runId}` })
  const stopRenewing = writer.keepAlive((e) => console.error(`${runId}: lease lost: ${e.message}`))
  try {
    const sandbox = await sandboxes.create(thread)
    console.log(
      `${runId}: writer token ${writer.token}, sandbox ${sandbox.outcome} at ${
        sandbox.base?.slice(0, 12) ?? 'an empty thread'
      } (${sandbox.mode}) in ${ms(t)}`,
    )
    await work(sandbox)
    t = performance.now()
    const head = await checkpoints.getHead(thread)
    const { checkpoint, changedFiles } = await checkpoints.append({
      checkpoint: {
        threadId: thread,
        sandbox,
        reason: `after ${runId}`,
        sourceRunId: runId,
        conversation: [{ role: 'assistant', content: `${runId} done` }],
      },
      expectedHeadId: head,
      writer,
    })
    console.log(
      `${runId}: published ${checkpoint.id.slice(0, 12)} (${changedFiles} changed) in ${ms(t)}`,
    )
    return { checkpoint, sandbox }
  } finally {
    stopRenewing()
    await writer.release()
  }
}

let failed = false
try {
  const first = await run('run-1', (sb) => {
    writeFileSync(join(sb.path, 'plan.md'), '# plan\n- step one\n')
    writeFileSync(join(sb.path, 'main.py'), 'print("hello")\n')
  })
  // The first run's sandbox goes away (its VM was recycled, say).
  await first.sandbox.destroy()

  const second = await run('run-2', async (sb) => {
    const plan = readFileSync(join(sb.path, 'plan.md'), 'utf8')
    console.log(`run-2: resumed plan.md from run-1: ${JSON.stringify(plan)}`)
    if (!plan.includes('step one')) throw new Error('run-2 did not see run-1 files')
    appendFileSync(join(sb.path, 'plan.md'), '- step two\n')

    // Meanwhile a third run on the same thread: refused while run-2 holds it.
    try {
      await checkpoints.acquireWriter(thread, { holder: 'agent-loop run-3' })
      throw new Error('run-3 was let in while run-2 held the thread')
    } catch (e) {
      if (!(e instanceof SandboxCheckpointError) || e.code !== 'SANDBOX_SNAPSHOT_LEASE_HELD')
        throw e
      console.log(`run-3: refused (${e.code}): ${e.message}`)
    }
  })
  if (second.checkpoint.parent_id !== first.checkpoint.id)
    throw new Error('run-2 did not publish on top of run-1')
  const log = await checkpoints.log(thread)
  console.log(`thread ${thread}: ${log.map((c) => `${c.id.slice(0, 12)} (${c.reason})`).join(' <- ')}`)
  await second.sandbox.destroy()
} catch (e) {
  failed = true
  console.error(e)
} finally {
  await served.stop()
  rmSync(dir, { recursive: true, force: true })
}
process.exitCode = failed ? 1 : 0
