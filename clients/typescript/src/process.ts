/**
 * Processes of a casfs sandbox: a POSIX shell on this host, in the sandbox's mounted
 * workspace, as the calling user. Each process leads a process group of its own, so a
 * kill (or an aborted `signal`, or the sandbox's destroy) reaches everything it
 * started, background grandchildren included. Output streams as it arrives.
 *
 * This is no isolation: the processes are the host's, with the host's network and
 * files beyond the workspace (see the package README).
 */
import { spawn, type ChildProcess } from 'node:child_process'

import { Chunks } from './chunks.js'
import type { ExecResult, ProcessOptions, SpawnHandle } from './contracts.js'

/** What the processes of one sandbox share. */
export interface ProcessHost {
  /** Resolves a `cwd` option to a directory of the workspace. */
  cwd: (cwd: string | undefined) => string
  /** The environment of a process with `extra` over the sandbox's. */
  env: (extra: Record<string, string> | undefined) => NodeJS.ProcessEnv
  shell: string
  /**
   * The program that runs a shell command in `cwd` (default: the shell itself there). A
   * sandbox in a user namespace (a non-root server's overlay mount) runs it through
   * `casfs exec`, which enters the namespace first.
   */
  launch?: (command: string, cwd: string) => { file: string; args: string[]; cwd: string }
}

const signals: Record<string, number> = { SIGHUP: 1, SIGINT: 2, SIGKILL: 9, SIGTERM: 15 }

function exitCodeOf(code: number | null, signal: NodeJS.Signals | null): number {
  if (code !== null) return code
  return 128 + (signal ? (signals[signal] ?? 1) : 1)
}

/** Sends `signal` to the whole process group `child` leads. */
function killGroup(child: ChildProcess, signal: NodeJS.Signals | number = 'SIGTERM'): void {
  if (child.pid === undefined) return
  try {
    process.kill(-child.pid, signal)
  } catch {
    // Gone already (ESRCH), or never started.
  }
}

/** The processes of one sandbox, so that its destroy ends every one. */
export class SandboxProcesses {
  private readonly live = new Set<ChildProcess>()

  constructor(private readonly host: ProcessHost) {}

  private start(command: string, options: ProcessOptions | undefined): ChildProcess {
    if (options?.signal?.aborted) {
      throw Object.assign(new Error('the operation was aborted before it started'), {
        name: 'AbortError',
      })
    }
    const cwd = this.host.cwd(options?.cwd)
    const how = this.host.launch?.(command, cwd) ?? {
      file: this.host.shell,
      args: ['-c', command],
      cwd,
    }
    const child = spawn(how.file, how.args, {
      cwd: how.cwd,
      env: this.host.env(options?.env),
      detached: true,
      stdio: ['pipe', 'pipe', 'pipe'],
    })
    this.live.add(child)
    child.once('close', () => this.live.delete(child))
    child.once('error', () => this.live.delete(child))
    // A process whose stdin is closed early must not take us down with EPIPE.
    child.stdin?.on('error', () => {})
    if (options?.signal) {
      const onAbort = (): void => killGroup(child, 'SIGKILL')
      options.signal.addEventListener('abort', onAbort, { once: true })
      child.once('close', () => options.signal?.removeEventListener('abort', onAbort))
    }
    return child
  }

  /** Runs `command` to its end; its output whole. */
  exec(command: string, options?: ProcessOptions): Promise<ExecResult> {
    let child: ChildProcess
    try {
      child = this.start(command, options)
    } catch (e) {
      return Promise.reject(e)
    }
    child.stdin?.end()
    const out = Chunks.of(child.stdout)
    const err = Chunks.of(child.stderr)
    return new Promise((resolve, reject) => {
      child.once('error', reject)
      child.once('close', (code, signal) => {
        if (options?.signal?.aborted) {
          reject(
            Object.assign(new Error(`aborted: ${command.slice(0, 80)}`), { name: 'AbortError' }),
          )
          return
        }
        resolve({ stdout: out.text(), stderr: err.text(), exitCode: exitCodeOf(code, signal) })
      })
    })
  }

  /** Starts `command` in the background. */
  spawn(command: string, options?: ProcessOptions): Promise<SpawnHandle> {
    let child: ChildProcess
    try {
      child = this.start(command, options)
    } catch (e) {
      return Promise.reject(e)
    }
    const stdout = Chunks.of(child.stdout)
    const stderr = Chunks.of(child.stderr)
    const exited = new Promise<number>((resolve, reject) => {
      child.once('error', reject)
      child.once('close', (code, signal) => resolve(exitCodeOf(code, signal)))
    })
    exited.catch(() => {})
    const stdin = child.stdin
    const handle: SpawnHandle = {
      pid: child.pid ?? -1,
      stdout,
      stderr,
      stdin: {
        write: (data) =>
          new Promise<void>((resolve, reject) => {
            if (!stdin || stdin.destroyed) {
              reject(new Error("the process's stdin is closed"))
              return
            }
            stdin.write(data, (e) => (e ? reject(e) : resolve()))
          }),
        end: () =>
          new Promise<void>((resolve) => {
            if (!stdin || stdin.destroyed || stdin.writableEnded) resolve()
            else stdin.end(() => resolve())
          }),
      },
      wait: () => exited,
      kill: (signal) => {
        killGroup(child, signal ?? 'SIGTERM')
        return Promise.resolve()
      },
    }
    return Promise.resolve(handle)
  }

  /** Ends every process of the sandbox (SIGTERM, then SIGKILL after `graceMs`). */
  async killAll(graceMs = 2_000): Promise<void> {
    const live = [...this.live]
    if (live.length === 0) return
    const closed = live.map(
      (c) =>
        new Promise<void>((r) => {
          if (c.exitCode !== null || c.signalCode !== null) r()
          else c.once('close', () => r())
        }),
    )
    for (const c of live) killGroup(c, 'SIGTERM')
    const timer = setTimeout(() => {
      for (const c of live) killGroup(c, 'SIGKILL')
    }, graceMs)
    await Promise.all(closed)
    clearTimeout(timer)
    // Grandchildren that outlived their leader (its group is gone with it otherwise).
    for (const c of live) killGroup(c, 'SIGKILL')
  }
}
