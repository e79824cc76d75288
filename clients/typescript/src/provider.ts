/**
 * casfs as a sandbox provider of TanStack AI's sandbox layer: `casfsSandbox(options)` is
 * a `SandboxProvider` whose sandboxes are workspaces mounted by `casfs serve` (the
 * kernel's overlayfs over a lazy casfs lower where the server may, else casfs's FUSE
 * filesystem), each on a casfs thread of its own.
 *
 * - `handle.snapshot(label)` is a casfs checkpoint of the workspace: it stores only what
 *   changed since the last one (O(changed files), milliseconds), under the thread's
 *   writer lease.
 * - `provider.restoreSnapshot({ snapshotId })` is a new sandbox mounted at that
 *   checkpoint: nothing is copied, contents load as they are read.
 * - `handle.fork()` is a snapshot, then a new sandbox at it.
 * - `fs` goes through the server (`/v1/sandboxes/{key}/fs/...`), which resolves every
 *   path beneath the workspace's root whatever links it holds and acts as the sandbox's
 *   owner; `fs.watch` follows casfs's own file events.
 * - `process.exec`/`spawn` run a POSIX shell through the server, isolated (the default,
 *   `isolation: 'sandbox'`): in bubblewrap, in the sandbox's own user, mount, pid, ipc,
 *   uts and network namespaces, the workspace at `/workspace` and a private `/tmp` the
 *   only places it writes, as an unprivileged user without capabilities, under the
 *   server's memory, pids and CPU limits and a seccomp filter, with only the environment
 *   the sandbox was given. Each process leads a process group of its own (a kill ends
 *   what it started; the sandbox's destroy ends them all). Nothing of this host is
 *   needed: the server may be another machine's (TCP with its token).
 * - `isolation: 'none'` runs them on this host instead, as the calling user with the
 *   host's network and files: no isolation. It needs the server's host.
 */
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'

import type { CasfsClient, Schemas } from './client.js'
import type {
  ExecResult,
  SandboxCapabilities,
  SandboxFsStat,
  SandboxGit,
  SandboxHandle,
  SandboxProvider,
  SnapshotRef,
} from './contracts.js'
import { CasfsError } from './errors.js'
import { lastEvent, sandboxEvents, type EventsOptions, type FileEvent } from './events.js'
import { IsolatedProcesses } from './isolated.js'
import { SandboxProcesses } from './process.js'

/** The virtual root the framework names the workspace by. */
export const WORKSPACE_ROOT = '/workspace'

export interface CasfsSandboxOptions {
  /** A client of `casfs serve` (see `connect`). */
  client: CasfsClient
  /**
   * Where processes run. `sandbox` (the default): through the server, isolated (see
   * above); the server may be on another host. `none`: on this host as the calling
   * user, in the workspace the server mounted here: no isolation.
   */
  isolation?: 'sandbox' | 'none'
  /**
   * Where an isolated sandbox's processes may go, through the proxy the server runs in
   * it (`HTTPS_PROXY`): `HOST`, `*.DOMAIN` or `ADDRESS`, with `:PORT` (else 80 and 443),
   * each within the server's `--sandbox-allow` list (else the create is refused). With
   * the framework's policy: `network: 'allow'` takes the server's whole list, `deny` or
   * `ask` only these (none given: no network at all). Neither this nor a policy: the
   * server's whole list.
   */
  allowNetwork?: string[]
  /** The server's tenant the sandboxes are made under (default `tanstack`). */
  tenant?: string
  /** The provider's name (default `casfs`). */
  name?: string
  /** The shell commands run in (default `/bin/sh`). */
  shell?: string
  /** Environment every process of every sandbox gets. */
  env?: Record<string, string>
  /**
   * `isolation: 'none'` only: start processes from this process's environment (default
   * true). An isolated sandbox's processes get only the environment they are given.
   */
  inheritEnv?: boolean
  /**
   * Record each sandbox's file events from its creation, so that `events({ after: 0 })`
   * sees every one (default false: from the first `fs.watch` or `events()` call, which
   * keeps creating and restoring a sandbox on overlay from walking its whole tree).
   */
  eventsFromCreate?: boolean
  /**
   * `isolation: 'none'` only: the casfs binary, for sandboxes of a server run by a user
   * who is not root, whose mounts live in that user's namespace: their processes start
   * through `casfs exec` (default: `$CASFS_BIN`, else `casfs` on PATH).
   */
  casfsBin?: string
}

/** What a casfs sandbox handle has besides the framework's contract. */
export interface CasfsSandboxHandle extends SandboxHandle {
  /** The casfs thread the sandbox's snapshots go on. */
  readonly thread: string
  /** `overlay` or `fuse`: how the server mounted the workspace. */
  readonly mode: string | null | undefined
  /** The workspace's file events as they happen (see `sandboxEvents`). */
  events: (options?: EventsOptions) => AsyncGenerator<FileEvent, void, undefined>
}

/** What a sandbox whose processes run on this host (`isolation: 'none'`) does. */
const HOST_CAPABILITIES: SandboxCapabilities = {
  fs: true,
  exec: true,
  env: true,
  ports: true,
  backgroundProcesses: true,
  writableStdin: true,
  killableProcesses: true,
  snapshots: true,
  networkPolicy: false,
  durableFilesystem: true,
  fork: true,
}

/** What an isolated sandbox does: its network is its own (loopback only, unless the
 * server gives it the host's), so a port it listens on is reached through a channel
 * the server opens (a URL and a token); where it may go is an allow-list the server's
 * proxy enforces (`allowNetwork`). */
const ISOLATED_CAPABILITIES: SandboxCapabilities = {
  ...HOST_CAPABILITIES,
  networkPolicy: true,
}

/** The network an isolated sandbox asks the server for, from the framework's policy and
 * the provider's `allowNetwork`: undefined for the server's whole list. */
function networkFor(
  policy: unknown,
  allowNetwork: string[] | undefined,
): { allow: string[] } | undefined {
  const p = policy as
    | { capabilities?: { network?: string }; default?: string }
    | undefined
  const decision = p === undefined ? undefined : (p.capabilities?.network ?? p.default ?? 'ask')
  if (decision === 'allow') return undefined
  if (decision === undefined && allowNetwork === undefined) return undefined
  return { allow: [...(allowNetwork ?? [])] }
}

/** `bin` as an absolute path, looked up on this process's `PATH` when it names no
 * directory (a sandbox's processes may get an environment without one). */
function onPath(bin: string): string {
  if (bin.includes('/')) return path.resolve(bin)
  for (const dir of (process.env.PATH ?? '').split(':')) {
    if (dir === '') continue
    const p = path.join(dir, bin)
    try {
      fs.accessSync(p, fs.constants.X_OK)
      return p
    } catch {
      // Not here.
    }
  }
  return bin
}

/** A fresh casfs thread for a sandbox; `hint` (the framework's key) kept readable. */
function newThread(hint: string): string {
  const safe = hint.replace(/[^A-Za-z0-9._:-]/g, '_').slice(0, 150) || 'sandbox'
  return `tsbx.${safe}.${randomBytes(6).toString('hex')}`
}

/** Maps a path the framework names (`/workspace/...`, absolute or relative) onto the
 * workspace, never outside it. */
function resolveIn(root: string, p: string): string {
  let rel: string
  if (p === root || p.startsWith(`${root}/`)) rel = path.relative(root, p)
  else if (p === WORKSPACE_ROOT) rel = ''
  else if (p.startsWith(`${WORKSPACE_ROOT}/`)) rel = p.slice(WORKSPACE_ROOT.length + 1)
  else if (p.startsWith('/')) rel = p.slice(1)
  else rel = p
  const resolved = path.resolve(root, rel)
  if (resolved !== root && !resolved.startsWith(`${root}/`)) {
    throw new Error(`casfs: path "${p}" resolves outside the sandbox's workspace`)
  }
  return resolved
}

/** A string as one word of a POSIX shell command. */
function quote(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`
}

function abortIf(signal: AbortSignal | undefined): void {
  if (signal?.aborted) {
    throw Object.assign(new Error('aborted'), { name: 'AbortError' })
  }
}

export function casfsSandbox(options: CasfsSandboxOptions): SandboxProvider {
  const client = options.client
  const tenant = options.tenant ?? 'tanstack'
  const name = options.name ?? 'casfs'
  const shell = options.shell ?? '/bin/sh'
  const inherit = options.inheritEnv ?? true
  const isolated = (options.isolation ?? 'sandbox') === 'sandbox'
  if (!['sandbox', 'none'].includes(options.isolation ?? 'sandbox')) {
    throw new Error(`casfs: isolation ${String(options.isolation)}: give 'sandbox' or 'none'`)
  }
  const CAPABILITIES = isolated ? ISOLATED_CAPABILITIES : HOST_CAPABILITIES

  const make = async (thread: string, policy?: unknown): Promise<Schemas['CreatedSandbox']> => {
    const network = isolated ? networkFor(policy, options.allowNetwork) : undefined
    return client.call(
      'POST /v1/sandboxes',
      client.api.POST('/v1/sandboxes', {
        body: {
          thread,
          tenant,
          events: options.eventsFromCreate ?? false,
          ...(network === undefined ? {} : { network }),
        },
      }),
    )
  }

  const drop = async (key: string): Promise<void> => {
    await client.call(
      `DELETE /v1/sandboxes/${encodeURIComponent(key)}`,
      client.api.DELETE('/v1/sandboxes/{key}', { params: { path: { key } } }),
    )
  }

  const handleOf = (
    info: Schemas['CreatedSandbox'],
    env: Record<string, string>,
    policy?: unknown,
  ): CasfsSandboxHandle => {
    const root = info.path
    const key = info.key
    const thread = info.thread
    const envVars: Record<string, string> = { ...(options.env ?? {}), ...env }
    const resolve = (p: string): string => resolveIn(root, p)
    // A mount in the server user's namespace: its processes run inside the namespace
    // (`casfs exec`).
    const ns = info.namespace ?? null
    // The workspace's files go through the server, which resolves every path beneath
    // the workspace's root whatever its links say, and acts as the sandbox's owner.
    const rel = (p: string): string => path.relative(root, resolve(p))
    const readBytes = async (p: string): Promise<Uint8Array> => {
      const answer = client.api.GET('/v1/sandboxes/{key}/fs/read', {
        params: { path: { key }, query: { path: rel(p) } },
        parseAs: 'arrayBuffer',
      })
      // An empty file is an empty body, which openapi-fetch answers as no data.
      const data = await client.call(
        `GET /v1/sandboxes/${key}/fs/read`,
        answer.then((r) =>
          r.response.ok && r.data === undefined ? { ...r, data: new ArrayBuffer(0) } : r,
        ),
      )
      return new Uint8Array(data as unknown as ArrayBuffer)
    }
    const stat = async (p: string, follow: boolean) => {
      try {
        return await client.call(
          `GET /v1/sandboxes/${key}/fs/stat`,
          client.api.GET('/v1/sandboxes/{key}/fs/stat', {
            params: { path: { key }, query: { path: rel(p), follow } },
          }),
        )
      } catch (e) {
        if (e instanceof CasfsError && e.kind === 'not_found') return undefined
        throw e
      }
    }
    // A path as the sandbox's processes see it: the workspace at `/workspace` when
    // isolated, the mount here otherwise.
    const inside = (p: string): string => {
      if (!isolated) return resolve(p)
      const r = rel(p)
      return r === '' ? WORKSPACE_ROOT : `${WORKSPACE_ROOT}/${r}`
    }
    const casfsBin = onPath(options.casfsBin ?? process.env.CASFS_BIN ?? 'casfs')
    const processes: IsolatedProcesses | SandboxProcesses = isolated
      ? new IsolatedProcesses({
          client,
          key,
          cwd: (c) => (c === undefined ? WORKSPACE_ROOT : inside(c)),
          env: (extra) => ({ ...envVars, ...(extra ?? {}) }),
          shell,
        })
      : new SandboxProcesses({
      cwd: (c) => (c === undefined ? root : resolve(c)),
      env: (extra) => ({ ...(inherit ? process.env : {}), ...envVars, ...(extra ?? {}) }),
      shell,
      ...(ns === null
        ? {}
        : {
            launch: (command: string, cwd: string) => ({
              file: casfsBin,
              args: [
                'exec',
                '--holder',
                String(ns.holder),
                '--cwd',
                cwd,
                root,
                '--',
                shell,
                '-c',
                command,
              ],
              cwd: '/',
            }),
          }),
    })
    const run = async (command: string, dir?: string): Promise<ExecResult> => {
      const r = await processes.exec(command, dir === undefined ? {} : { cwd: dir })
      if (r.exitCode !== 0) {
        throw new Error(`casfs: \`${command}\` exited ${r.exitCode}: ${r.stderr.trim()}`)
      }
      return r
    }
    const gitEnv =
      'GIT_AUTHOR_NAME="${GIT_AUTHOR_NAME:-casfs sandbox}" ' +
      'GIT_AUTHOR_EMAIL="${GIT_AUTHOR_EMAIL:-sandbox@casfs.invalid}" ' +
      'GIT_COMMITTER_NAME="${GIT_COMMITTER_NAME:-casfs sandbox}" ' +
      'GIT_COMMITTER_EMAIL="${GIT_COMMITTER_EMAIL:-sandbox@casfs.invalid}"'
    const git: SandboxGit = {
      clone: async ({ url, dir, ref, auth, depth }) => {
        const args = ['git']
        if (auth) {
          const basic = Buffer.from(`${auth.username ?? 'x-access-token'}:${auth.token}`).toString(
            'base64',
          )
          args.push('-c', quote(`http.extraHeader=Authorization: Basic ${basic}`))
        }
        args.push('clone')
        if (depth !== undefined && depth !== 'full') args.push('--depth', String(depth))
        if (ref !== undefined) args.push('--branch', quote(ref))
        args.push('--', quote(url), quote(dir === undefined ? '.' : inside(dir)))
        await run(args.join(' '))
      },
      status: async (dir) => (await run('git status --porcelain', dir)).stdout,
      add: async (paths, dir) => {
        await run(`git add -- ${paths.map(quote).join(' ')}`, dir)
      },
      commit: async (message, dir) => {
        await run(`${gitEnv} git commit -m ${quote(message)}`, dir)
      },
      push: async (dir) => {
        await run('git push', dir)
      },
      pull: async (dir) => {
        await run('git pull', dir)
      },
      branch: async (dir) => (await run('git rev-parse --abbrev-ref HEAD', dir)).stdout.trim(),
    }
    let snapshots: Promise<unknown> = Promise.resolve()
    const snapshot = (label?: string): Promise<SnapshotRef> => {
      // One at a time: each takes the thread's writer lease.
      const next = snapshots.then(async () => {
        const t = encodeURIComponent(thread)
        const lease = await client.call(
          `POST /v1/threads/${t}/writer`,
          client.api.POST('/v1/threads/{thread}/writer', {
            params: { path: { thread } },
            body: { holder: `casfs-ts snapshot of ${key}` },
          }),
        )
        const proof = { token: lease.token, owner_token: lease.owner_token }
        try {
          const head = await client.call(
            `GET /v1/threads/${t}/head`,
            client.api.GET('/v1/threads/{thread}/head', { params: { path: { thread } } }),
          )
          const r = await client.call(
            `POST /v1/threads/${t}/checkpoints`,
            client.api.POST('/v1/threads/{thread}/checkpoints', {
              params: { path: { thread } },
              body: {
                sandbox: key,
                expected_head: head.head ?? null,
                writer: proof,
                reason: label === undefined ? 'snapshot' : `snapshot: ${label}`,
                conversation: [],
              },
            }),
          )
          return label === undefined ? { id: r.checkpoint.id } : { id: r.checkpoint.id, label }
        } finally {
          await client
            .call(
              `POST /v1/threads/${t}/writer/release`,
              client.api.POST('/v1/threads/{thread}/writer/release', {
                params: { path: { thread } },
                body: proof,
              }),
            )
            .catch(() => {})
        }
      })
      snapshots = next.catch(() => {})
      return next
    }
    const handle: CasfsSandboxHandle = {
      id: key,
      provider: name,
      workspaceRoot: root,
      capabilities: { ...CAPABILITIES },
      thread,
      mode: info.mode,
      fs: {
        read: async (p) => Buffer.from(await readBytes(p)).toString('utf8'),
        readBytes: async (p) => readBytes(p),
        write: async (p, data) => {
          const bytes = typeof data === 'string' ? Buffer.from(data) : Buffer.from(data)
          await client.call(
            `PUT /v1/sandboxes/${key}/fs/write`,
            client.api.PUT('/v1/sandboxes/{key}/fs/write', {
              params: { path: { key }, query: { path: rel(p) } },
              body: bytes as unknown as string,
              bodySerializer: (b: unknown) => b as BodyInit,
              headers: { 'Content-Type': 'application/octet-stream' },
            }),
          )
        },
        list: async (p) => {
          const entries = await client.call(
            `GET /v1/sandboxes/${key}/fs/list`,
            client.api.GET('/v1/sandboxes/{key}/fs/list', {
              params: { path: { key }, query: { path: rel(p) } },
            }),
          )
          const base = p.replace(/\/$/, '')
          return entries.map((e) => ({
            name: e.name,
            path: `${base}/${e.name}`,
            type: e.type === 'dir' ? ('dir' as const) : ('file' as const),
          }))
        },
        mkdir: async (p) => {
          await client.call(
            `POST /v1/sandboxes/${key}/fs/mkdir`,
            client.api.POST('/v1/sandboxes/{key}/fs/mkdir', {
              params: { path: { key } },
              body: { path: rel(p) },
            }),
          )
        },
        remove: async (p) => {
          await client.call(
            `POST /v1/sandboxes/${key}/fs/remove`,
            client.api.POST('/v1/sandboxes/{key}/fs/remove', {
              params: { path: { key } },
              body: { path: rel(p) },
            }),
          )
        },
        rename: async (from, to) => {
          await client.call(
            `POST /v1/sandboxes/${key}/fs/rename`,
            client.api.POST('/v1/sandboxes/{key}/fs/rename', {
              params: { path: { key } },
              body: { from: rel(from), to: rel(to) },
            }),
          )
        },
        exists: async (p) => (await stat(p, true)) !== undefined,
        lstat: async (p): Promise<SandboxFsStat | undefined> => {
          const st = await stat(p, false)
          if (st === undefined) return undefined
          if (st.type === 'file') return { type: 'file', mode: st.mode, size: st.size }
          return { type: st.type, mode: st.mode }
        },
        watch: async (p, onEvent) => {
          const base = p.replace(/\/+$/, '')
          const under = path.relative(root, resolve(p))
          const ac = new AbortController()
          const after = await lastEvent(client, key)
          const emit = (rel: string, type: string): void => {
            if (under !== '' && rel !== under && !rel.startsWith(`${under}/`)) return
            const tail = under === '' ? rel : rel.slice(under.length + 1)
            onEvent({ type, path: tail === '' ? base : `${base}/${tail}` })
          }
          const done = (async () => {
            for await (const ev of sandboxEvents(client, key, { after, signal: ac.signal })) {
              if (ev.kind === 'lost') continue
              emit(ev.path, ev.kind)
              if (ev.kind === 'rename' && typeof ev.to === 'string') emit(ev.to, 'rename')
            }
          })().catch(() => {})
          return {
            stop: async () => {
              ac.abort()
              await done
            },
          }
        },
      },
      git,
      process: {
        exec: (command, opts) => processes.exec(command, opts),
        spawn: (command, opts) => processes.spawn(command, opts),
      },
      ports: {
        connect: async (port) => {
          if (!isolated) return { url: `http://127.0.0.1:${port}` }
          // A channel on the server's host to the port in the sandbox's own network:
          // every connection's first request carries the token in the header.
          const c = await client.call(
            `POST /v1/sandboxes/${key}/ports`,
            client.api.POST('/v1/sandboxes/{key}/ports', {
              params: { path: { key } },
              body: { port },
            }),
          )
          return { url: c.url, token: c.token, headers: { [c.header]: c.token } }
        },
      },
      env: {
        set: (vars) => {
          Object.assign(envVars, vars)
          return Promise.resolve()
        },
      },
      events: (o) => sandboxEvents(client, key, o),
      snapshot,
      fork: async () => {
        const snap = await snapshot('fork')
        return restore(snap.id, envVars, policy)
      },
      destroy: async () => {
        // The server's destroy ends an isolated sandbox's processes with it.
        if (!isolated) await processes.killAll()
        await drop(key)
      },
    }
    return handle
  }

  const restore = async (
    snapshotId: string,
    env: Record<string, string>,
    policy?: unknown,
  ): Promise<CasfsSandboxHandle> => {
    const thread = newThread('restore')
    await client.call(
      `POST /v1/threads/${thread}/fork`,
      client.api.POST('/v1/threads/{thread}/fork', {
        params: { path: { thread } },
        body: { from: snapshotId },
      }),
    )
    return handleOf(await make(thread, policy), env, policy)
  }

  return {
    name,
    capabilities: () => ({ ...CAPABILITIES }),
    create: async (input) => {
      abortIf(input.signal)
      return handleOf(
        await make(newThread(input.id ?? 'sandbox'), input.policy),
        input.env ?? {},
        input.policy,
      )
    },
    resume: async (input) => {
      abortIf(input.signal)
      const live = await client.call('GET /v1/sandboxes', client.api.GET('/v1/sandboxes'))
      const found = live.find((s) => s.key === input.id)
      if (!found || typeof found.thread !== 'string') return null
      const info = await make(found.thread)
      if (info.outcome !== 'resumed') {
        // Gone in between (destroyed, evicted): what was made now is not the sandbox.
        await drop(info.key).catch(() => {})
        return null
      }
      return handleOf(info, {})
    },
    restoreSnapshot: async (input) => {
      abortIf(input.signal)
      return restore(input.snapshotId, input.env ?? {}, input.policy)
    },
    destroy: async (input) => {
      abortIf(input.signal)
      try {
        await drop(input.id)
      } catch (e) {
        if (e instanceof CasfsError && e.kind === 'not_found') return
        throw e
      }
    },
  }
}
