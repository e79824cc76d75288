// The agent-loop benchmark: the same scripted loop (each run: a sandbox at the
// thread's latest state, 10 files changed, the state captured) on workspaces of 1k,
// 10k and 100k files of 300 bytes, per "path" (how a host gets and keeps a sandbox's
// state). Per run it times the restore at setup (a new sandbox showing the latest
// state: the worst case, a host that lost its sandbox) and the capture at finish; the
// 10 writes and the teardown are not timed.
//
// This file measures casfs's native path (casfsSandbox: a restore is a mount of the
// last snapshot, a capture is a casfs checkpoint). `runLoop` takes other paths too.
// Run: `npm run bench -- --sizes 1k,10k --runs 5 --out DIR/` (a built casfs:
// CASFS_BIN, else ../../target/release/casfs; root with /dev/fuse; CASFS_MOUNT_MODE).
import { execFileSync } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'

import { casfsSandbox, startCasfsServe, type SandboxHandle } from '../src/index.js'

/** How one host gets and keeps its sandboxes' state. */
export interface LoopPath {
  readonly name: string
  /** Makes the thread's first state: a workspace holding `files`. */
  seed: (files: ReadonlyArray<[string, string]>) => Promise<void>
  /** A new sandbox showing the thread's latest state (timed: "restore"). */
  restore: () => Promise<SandboxHandle>
  /** Keeps the sandbox's state as the thread's latest (timed: "capture"). */
  capture: (h: SandboxHandle, runId: string) => Promise<void>
  /** Tears the sandbox down (not timed). */
  dispose: (h: SandboxHandle) => Promise<void>
  close: () => Promise<void>
}

export interface LoopRow {
  path: string
  files: number
  /** Milliseconds of each run, in order. */
  restore_ms: number[]
  capture_ms: number[]
  total_ms: number[]
  restore_median_ms: number
  capture_median_ms: number
  total_median_ms: number
}

/** The middle of the sorted runs (the upper of the two middles for an even count). */
const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[xs.length >> 1] as number

/** The workspace of `n` files of 300 bytes, 100 to a directory. */
export function workspace(n: number): Array<[string, string]> {
  const out: Array<[string, string]> = []
  for (let i = 0; i < n; i++) {
    const body = `file ${i} `.padEnd(299, String.fromCharCode(97 + (i % 26))) + '\n'
    out.push([`d${Math.floor(i / 1000)}/e${Math.floor(i / 100) % 10}/f${i}.txt`, body])
  }
  return out
}

/** Runs the loop `runs` times on `path` with a workspace of `n` files. */
export async function runLoop(path: LoopPath, n: number, runs: number): Promise<LoopRow> {
  const files = workspace(n)
  await path.seed(files)
  const row: LoopRow = {
    path: path.name,
    files: n,
    restore_ms: [],
    capture_ms: [],
    total_ms: [],
    restore_median_ms: 0,
    capture_median_ms: 0,
    total_median_ms: 0,
  }
  for (let r = 0; r < runs; r++) {
    let t = performance.now()
    const h = await path.restore()
    const restore = performance.now() - t
    for (let k = 0; k < 10; k++) {
      const [p] = files[(r * 10 + k) * 7919 % n] as [string, string]
      await h.fs.write(`/workspace/${p}`, `changed by run ${r}, file ${k}\n`)
    }
    t = performance.now()
    await path.capture(h, `run-${r}`)
    const capture = performance.now() - t
    await path.dispose(h)
    row.restore_ms.push(restore)
    row.capture_ms.push(capture)
    row.total_ms.push(restore + capture)
  }
  row.restore_median_ms = median(row.restore_ms)
  row.capture_median_ms = median(row.capture_ms)
  row.total_median_ms = median(row.total_ms)
  return row
}

/** casfs's native path: restores mount the last snapshot, captures are checkpoints. */
export async function casfsNative(bin: string): Promise<LoopPath> {
  const dir = mkdtempSync(join(tmpdir(), 'casfs-loop-'))
  const served = await startCasfsServe({ bin, store: join(dir, 'store') })
  const provider = casfsSandbox({ client: served.client })
  let latest = ''
  return {
    name: 'casfs provider, native snapshots',
    seed: async (files) => {
      const h = await provider.create({ id: 'bench' })
      for (const [p, body] of files) await h.fs.write(`/workspace/${p}`, body)
      latest = (await h.snapshot!('seed')).id
      await h.destroy()
    },
    restore: () => provider.restoreSnapshot!({ snapshotId: latest }),
    capture: async (h, runId) => {
      latest = (await h.snapshot!(runId)).id
    },
    dispose: (h) => h.destroy(),
    close: async () => {
      await served.stop()
      rmSync(dir, { recursive: true, force: true })
    },
  }
}

function sizeOf(s: string): number {
  const m = /^(\d+)([km]?)$/.exec(s.trim())
  if (!m) throw new Error(`--sizes: ${s}: give counts like 1000, 10k or 1m`)
  return Number(m[1]) * (m[2] === 'k' ? 1000 : m[2] === 'm' ? 1_000_000 : 1)
}

/**
 * Writes the bench's result file (docs/results/README.md: every run of every row, the
 * machine, the commit) through `casfs bench --record agent-loop`, which `bin` is.
 */
export function record(
  bin: string,
  command: string,
  benchDir: string,
  rows: LoopRow[],
  params: Record<string, unknown>,
  out: string,
): void {
  const lines = [JSON.stringify({ param: params })]
  for (const r of rows) {
    for (const [phase, runs] of [
      ['restore at setup', r.restore_ms],
      ['capture at finish', r.capture_ms],
      ['total', r.total_ms],
    ] as const) {
      lines.push(JSON.stringify({ path: r.path, files: r.files, phase, unit: 'ms', runs }))
    }
  }
  execFileSync(
    bin,
    ['bench', '--record', 'agent-loop', '--command', command, '--bench-dir', benchDir, '--out', out],
    { input: `${lines.join('\n')}\n`, stdio: ['pipe', 'inherit', 'inherit'] },
  )
}

export function printRows(rows: LoopRow[]): void {
  console.log('| path | files | restore ms | capture ms | total ms |')
  console.log('|---|---:|---:|---:|---:|')
  for (const r of rows) {
    console.log(
      `| ${r.path} | ${r.files} | ${r.restore_median_ms.toFixed(1)} | ${r.capture_median_ms.toFixed(1)} | ${r.total_median_ms.toFixed(1)} |`,
    )
  }
}

async function main(): Promise<void> {
  const args = process.argv.slice(2)
  const opt = (name: string, dflt: string): string => {
    const i = args.indexOf(`--${name}`)
    return i >= 0 && args[i + 1] !== undefined ? (args[i + 1] as string) : dflt
  }
  const sizes = opt('sizes', '1k,10k,100k').split(',').map(sizeOf)
  const runs = Number(opt('runs', '5'))
  const out = opt('out', '')
  const bin =
    process.env.CASFS_BIN ?? resolve(import.meta.dirname, '../../../target/release/casfs')
  const rows: LoopRow[] = []
  for (const n of sizes) {
    const path = await casfsNative(bin)
    try {
      rows.push(await runLoop(path, n, runs))
    } finally {
      await path.close()
    }
  }
  printRows(rows)
  if (out) {
    record(bin, ['npm run bench --', ...args].join(' '), tmpdir(), rows, {
      sizes,
      runs,
      changed_files_per_run: 10,
      file_bytes: 300,
      mount_mode: process.env.CASFS_MOUNT_MODE ?? 'auto',
      node: process.version,
    }, out)
  }
}

if (import.meta.url === `file://${process.argv[1]}`) await main()
