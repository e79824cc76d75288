// The casfs sandbox provider on a real `casfs serve` (the backend CASFS_MOUNT_MODE
// names): the framework's provider and handle contract: fs on the mount (lstat, list
// paths as the framework joins them, watch), a shell that streams, takes stdin and
// is killed with everything it started, env, git, and native snapshots: a snapshot is
// a casfs checkpoint, a restore and a fork are new mounts of one. Processes run
// isolated through the server by default; `isolation: 'none'` runs them on this host.
import { execFileSync } from 'node:child_process'
import { createServer as httpServer } from 'node:http'
import { randomBytes } from 'node:crypto'
import { existsSync, mkdtempSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { afterAll, beforeAll, describe, expect, test } from 'vitest'

import {
  casfsSandbox,
  connect,
  type CasfsSandboxHandle,
  type SandboxHandle,
  type SandboxProvider,
} from '../src/index.js'
import { freePort, serve, sleep } from './helpers.js'

let s: Awaited<ReturnType<typeof serve>>
let provider: SandboxProvider
const made: SandboxHandle[] = []

beforeAll(async () => {
  s = await serve()
  provider = casfsSandbox({ client: s.client })
})
afterAll(async () => {
  for (const h of made) await h.destroy().catch(() => {})
  await s?.cleanup()
})

async function create(id = 'test'): Promise<CasfsSandboxHandle> {
  const h = (await provider.create({ id })) as CasfsSandboxHandle
  made.push(h)
  return h
}

/** Whether process `pid` exists. */
function alive(pid: number): boolean {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

describe('provider', () => {
  test('declares what it does and makes mounted workspaces', async () => {
    expect(provider.name).toBe('casfs')
    expect(provider.capabilities()).toEqual({
      fs: true,
      exec: true,
      env: true,
      ports: true,
      backgroundProcesses: true,
      writableStdin: true,
      killableProcesses: true,
      snapshots: true,
      networkPolicy: true,
      durableFilesystem: true,
      fork: true,
    })
    const h = await create('a:key/with spaces')
    expect(h.provider).toBe('casfs')
    expect(h.thread).toMatch(/^tsbx\.a:key_with_spaces\.[0-9a-f]{12}$/)
    expect(h.workspaceRoot && statSync(h.workspaceRoot).isDirectory()).toBe(true)
    expect(['overlay', 'fuse']).toContain(h.mode)
    // Own properties: a handle copied with a spread works the same.
    const copy = { ...h, process: { ...h.process } }
    expect((await copy.process.exec('echo spread')).stdout).toBe('spread\n')
    expect(await copy.fs.exists('/workspace')).toBe(true)
  })

  // Boundary 6 (provider fs): links the workspace holds never lead the provider's fs
  // out of it (the server resolves every path beneath the workspace's root).
  test('fs never follows a link of the workspace out of it', async () => {
    const h = await create()
    const outside = mkdtempSync(join(tmpdir(), 'casfs-outside-'))
    try {
      writeFileSync(join(outside, 'secret.txt'), 'outside')
      const r = await h.process.exec(
        `ln -s '${outside}/made.txt' notes.md && ln -s '${outside}/secret.txt' s && ` +
          `ln -s '${outside}' d && ln -s ../../../../../../.. up`,
      )
      expect(r.exitCode).toBe(0)
      await h.fs.write('/workspace/notes.md', 'x').catch(() => {})
      await h.fs.write('/workspace/d/new.txt', 'n').catch(() => {})
      await h.fs.mkdir('/workspace/d/newdir').catch(() => {})
      await expect(h.fs.read('/workspace/s')).rejects.toThrow()
      await expect(h.fs.read(`/workspace/up${outside}/secret.txt`)).rejects.toThrow()
      expect(readdirSync(outside)).toEqual(['secret.txt'])
      // `..` stops at the workspace's root.
      const names = (await h.fs.list('/workspace/up')).map((e) => e.name)
      expect(names).toContain('notes.md')
      await h.fs.remove('/workspace/s')
      expect(existsSync(join(outside, 'secret.txt'))).toBe(true)
    } finally {
      rmSync(outside, { recursive: true, force: true })
    }
  })

  test('fs maps /workspace, absolute and relative paths into the mount, never out', async () => {
    const h = await create()
    await h.fs.write('/workspace/a/b.txt', 'hello')
    expect(await h.fs.read('a/b.txt')).toBe('hello')
    expect(await h.fs.read(`${h.workspaceRoot}/a/b.txt`)).toBe('hello')
    await h.fs.write('/workspace/empty', '')
    expect(await h.fs.read('/workspace/empty')).toBe('')
    expect((await h.fs.readBytes('/workspace/empty')).length).toBe(0)
    await h.fs.write('/tmp/inside', new Uint8Array([1, 2, 3]))
    expect([...(await h.fs.readBytes('/workspace/tmp/inside'))]).toEqual([1, 2, 3])
    await expect(h.fs.read('/workspace/../../etc/passwd')).rejects.toThrow(/outside/)
    expect(await h.fs.list('/workspace/a')).toEqual([{ name: 'b.txt', path: '/workspace/a/b.txt', type: 'file' }])
    expect(await h.fs.list('/workspace/')).toEqual(
      expect.arrayContaining([{ name: 'a', path: '/workspace/a', type: 'dir' }]),
    )
    await h.fs.mkdir('/workspace/x/y')
    await h.fs.rename('/workspace/a/b.txt', '/workspace/x/y/c.txt')
    expect(await h.fs.exists('/workspace/a/b.txt')).toBe(false)
    await h.process.exec('ln -s c.txt x/y/link && chmod 755 x/y/c.txt && mkfifo x/p')
    expect(await h.fs.lstat!('/workspace/x/y/link')).toMatchObject({ type: 'symlink' })
    const file = await h.fs.lstat!('/workspace/x/y/c.txt')
    expect(file).toMatchObject({ type: 'file', size: 5 })
    expect((file!.mode & 0o777).toString(8)).toBe('755')
    expect(await h.fs.lstat!('/workspace/x')).toMatchObject({ type: 'dir' })
    expect(await h.fs.lstat!('/workspace/x/p')).toMatchObject({ type: 'other' })
    expect(await h.fs.lstat!('/workspace/none')).toBeUndefined()
    await h.fs.remove('/workspace/x')
    expect(await h.fs.exists('/workspace/x')).toBe(false)
  })

  test('watch reports changes under the watched path, from casfs events', async () => {
    const h = await create()
    await h.fs.mkdir('/workspace/w')
    const seen: Array<{ type: string; path: string }> = []
    const w = await h.fs.watch!('/workspace/w', (e) => seen.push(e))
    await h.fs.write('/workspace/w/one.txt', '1')
    await h.fs.write('/workspace/elsewhere.txt', '2')
    for (let i = 0; i < 100 && !seen.some((e) => e.path === '/workspace/w/one.txt'); i++) await sleep(50)
    await w.stop()
    expect(seen.some((e) => e.path === '/workspace/w/one.txt')).toBe(true)
    expect(seen.some((e) => e.path.includes('elsewhere'))).toBe(false)
  })

  test('events are recorded from the first watch, or from creation when asked', async () => {
    const seqs = async (h: CasfsSandboxHandle): Promise<string[]> => {
      const got: string[] = []
      const ac = new AbortController()
      setTimeout(() => ac.abort(), 500)
      for await (const e of h.events({ after: 0, signal: ac.signal, waitMs: 200 })) {
        if ('path' in e) got.push(`${e.kind} ${e.path}`)
      }
      return got
    }
    // By default: what happened before the first read is not recorded.
    const lazy = await create('events-lazy')
    await lazy.fs.write('/workspace/early.txt', 'e')
    await sleep(200)
    expect(await seqs(lazy)).toEqual([])
    // Asked for: every event since creation.
    const eager = casfsSandbox({ client: s.client, eventsFromCreate: true })
    const h = (await eager.create({ id: 'events-eager' })) as CasfsSandboxHandle
    made.push(h)
    await h.fs.write('/workspace/early.txt', 'e')
    await sleep(300)
    expect(await seqs(h)).toContain('create early.txt')
  })

  test('exec runs a shell in the workspace with the env, and reports exit codes', async () => {
    const h = await create()
    await h.env.set({ GREETING: 'hi there' })
    const r = await h.process.exec('pwd; echo "$GREETING $EXTRA"; echo err >&2; exit 3', {
      env: { EXTRA: 'and more' },
    })
    expect(r.stdout).toBe('/workspace\nhi there and more\n')
    expect(r.stderr).toBe('err\n')
    expect(r.exitCode).toBe(3)
    await h.fs.mkdir('/workspace/sub')
    expect((await h.process.exec('pwd', { cwd: '/workspace/sub' })).stdout).toBe('/workspace/sub\n')
    expect((await h.process.exec('pwd', { cwd: 'sub' })).stdout).toBe('/workspace/sub\n')
    const ac = new AbortController()
    const slow = h.process.exec('sleep 30', { signal: ac.signal })
    setTimeout(() => ac.abort(), 100)
    await expect(slow).rejects.toThrow(/abort/)
  })

  test('spawn streams output as it comes, takes stdin, and its kill ends the whole tree', async () => {
    const h = await create()
    const p = await h.process.spawn('read line; echo "got $line"; sleep 0.3; echo later')
    await p.stdin.write('input\n')
    const it = p.stdout[Symbol.asyncIterator]()
    const first = await it.next()
    expect(first.value).toBe('got input\n')
    expect(await p.wait()).toBe(0)
    // A background grandchild that would write a heartbeat forever.
    const k = await h.process.spawn(`( while :; do date +%s%N > beat; sleep 0.1; done ) & echo $!; wait`)
    const pid = Number((await k.stdout[Symbol.asyncIterator]().next()).value)
    // Pids are the sandbox's own: the grandchild is seen from inside it.
    const alive = async (): Promise<boolean> =>
      (await h.process.exec(`kill -0 ${pid} 2>/dev/null`)).exitCode === 0
    expect(await alive()).toBe(true)
    await k.kill()
    expect(await k.wait()).toBeGreaterThan(128)
    for (let i = 0; i < 50 && (await alive()); i++) await sleep(50)
    expect(await alive()).toBe(false)
    const last = await h.fs.read('/workspace/beat')
    await sleep(300)
    expect(await h.fs.read('/workspace/beat')).toBe(last)
    expect(await p.wait()).toBe(0)
    // Output split inside a UTF-8 character comes back whole; stderr apart.
    const u = await h.process.spawn(`printf '\\303'; sleep 0.2; printf '\\251 caf\\303\\251\\n'; echo e >&2`)
    let text = ''
    for await (const c of u.stdout) text += c
    expect(text).toBe('é café\n')
    expect(await u.wait()).toBe(0)
    let err = ''
    for await (const c of u.stderr) err += c
    expect(err).toBe('e\n')
  })

  test('destroy ends the sandbox processes and unmounts it', async () => {
    const h = await create()
    const p = await h.process.spawn('sleep 60 & wait')
    await h.destroy()
    expect(await p.wait()).toBeGreaterThan(128)
    expect(await provider.resume({ id: h.id })).toBeNull()
    expect(existsSync(h.workspaceRoot!)).toBe(false)
  })

  test('git runs in the workspace', async () => {
    const h = await create()
    await h.process.exec('git init -q -b main .')
    await h.fs.write('/workspace/readme.md', 'hi')
    await h.git.add(['readme.md'])
    await h.git.commit("it's the first")
    expect(await h.git.branch()).toBe('main')
    expect(await h.git.status()).toBe('')
    const log = await h.process.exec('git log --format=%s')
    expect(log.stdout).toBe("it's the first\n")
  })

  test("an isolated sandbox's port is reached through its channel, with its token", async () => {
    const h = await create()
    await h.fs.write('/workspace/page.txt', 'served inside')
    const server = await h.process.spawn(
      'exec python3 -m http.server 8123 --bind 127.0.0.1 --directory /workspace',
    )
    const up = await h.process.exec(
      `python3 -c 'import socket, time
for _ in range(200):
  try:
    socket.create_connection(("127.0.0.1", 8123)).close(); print("up"); break
  except OSError: time.sleep(0.05)'`,
    )
    expect(up.stdout).toBe('up\n')
    const ch = await h.ports.connect(8123)
    expect(ch.url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/)
    const page = await fetch(`${ch.url}/page.txt`, { headers: ch.headers ?? {} })
    expect(page.status).toBe(200)
    expect(await page.text()).toBe('served inside')
    // Without the token the channel refuses before the sandbox.
    const refused = await fetch(`${ch.url}/page.txt`)
    expect(refused.status).toBe(403)
    await server.kill()
  })

  test('a snapshot is a checkpoint; restore and fork mount it', async () => {
    const h = await create()
    await h.fs.write('/workspace/src/a.txt', 'one')
    const snap = await h.snapshot!('first')
    expect(snap.id).toMatch(/^[0-9a-f]{64}$/)
    expect(snap.label).toBe('first')
    await h.fs.write('/workspace/src/a.txt', 'two')
    await h.fs.write('/workspace/later.txt', 'later')
    const again = await h.snapshot!()
    expect(again.id).not.toBe(snap.id)
    // A restore is a new sandbox at the snapshot; the original goes on as it was.
    const r = (await provider.restoreSnapshot!({ snapshotId: snap.id, env: { FROM: 'restore' } })) as CasfsSandboxHandle
    made.push(r)
    expect(r.id).not.toBe(h.id)
    expect(await r.fs.read('/workspace/src/a.txt')).toBe('one')
    expect(await r.fs.exists('/workspace/later.txt')).toBe(false)
    expect((await r.process.exec('echo $FROM')).stdout).toBe('restore\n')
    expect(await h.fs.read('/workspace/src/a.txt')).toBe('two')
    // A fork has this moment's files, then each goes its own way.
    const f = (await h.fork!()) as CasfsSandboxHandle
    made.push(f)
    expect(await f.fs.read('/workspace/later.txt')).toBe('later')
    await f.fs.write('/workspace/later.txt', 'forked')
    expect(await h.fs.read('/workspace/later.txt')).toBe('later')
    // Snapshots of a restored sandbox go on its own thread.
    const rs = await r.snapshot!()
    const head = await s.client.call(
      'head',
      s.client.api.GET('/v1/threads/{thread}/head', { params: { path: { thread: r.thread } } }),
    )
    expect(head.head).toBe(rs.id)
    const nope = await provider.restoreSnapshot!({ snapshotId: 'f'.repeat(64) }).catch((e: unknown) => e)
    expect((nope as { kind?: string }).kind).toBe('not_found')
  })

  test('a sandbox outlives the host process that made it: resume finds it by id', async () => {
    const h = await create()
    await h.fs.write('/workspace/kept.txt', 'still here')
    // Another process of the host (a new client, a new provider).
    const c2 = connect({ socketPath: s.served.socketPath })
    try {
      const p2 = casfsSandbox({ client: c2 })
      const back = await p2.resume({ id: h.id })
      expect(back?.id).toBe(h.id)
      expect(await back!.fs.read('/workspace/kept.txt')).toBe('still here')
      expect(await p2.resume({ id: 'tanstack+nothing-here' })).toBeNull()
      await p2.destroy({ id: 'tanstack+nothing-here' })
    } finally {
      await c2.close()
    }
  })

  test('processes are isolated: another user, only their own environment and files', async () => {
    process.env.CASFS_TS_TEST_SECRET = 'host-only-value'
    try {
      const h = await create()
      await h.env.set({ GIVEN: 'yes' })
      const r = await h.process.exec(
        'id -u; echo "secret=${CASFS_TS_TEST_SECRET:-unset} given=$GIVEN"; ' +
          'ls /root 2>&1 >/dev/null && echo root-listed; ' +
          'touch /etc/x /usr/x 2>/dev/null && echo wrote-outside; ' +
          'touch /tmp/ok /workspace/ok && echo wrote-inside; ' +
          'test -e ' + quote(s.served.socketPath) + ' && echo socket-seen; ' +
          'cat /proc/1/cmdline | tr "\\0" " "; echo',
      )
      const lines = r.stdout.split('\n')
      // Never root; a root server's sandbox is its stand-in user's, not the caller's (a
      // server of another user runs them as that user, the one it can be).
      expect(lines[0]).not.toBe('0')
      if (process.getuid?.() === 0) expect(lines[0]).toBe('65534')
      expect(lines[1]).toBe('secret=unset given=yes')
      expect(r.stdout).not.toContain('root-listed')
      expect(r.stdout).not.toContain('wrote-outside')
      expect(r.stdout).toContain('wrote-inside')
      expect(r.stdout).not.toContain('socket-seen')
      // Its pid 1 is the sandbox's init, not this host's.
      expect(lines.at(-2)).toContain('sandbox-init')
      expect(await h.fs.exists('/workspace/ok')).toBe(true)
      // No network but its own loopback.
      const net = await h.process.exec('cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d " "')
      expect(net.stdout.trim().split('\n')).toEqual(['lo'])
    } finally {
      delete process.env.CASFS_TS_TEST_SECRET
    }
  })
})

function quote(x: string): string {
  return `'${x.replace(/'/g, `'\\''`)}'`
}

describe("isolation: 'none'", () => {
  let host: SandboxProvider
  beforeAll(() => {
    host = casfsSandbox({ client: s.client, isolation: 'none' })
  })

  test('processes run as the caller, in the mount, with its ports (no isolation)', async () => {
    expect(host.capabilities().ports).toBe(true)
    expect(host.capabilities().networkPolicy).toBe(false)
    const h = (await host.create({ id: 'host' })) as CasfsSandboxHandle
    made.push(h)
    const who = (await h.process.exec('id -u')).stdout.trim()
    expect(who).toBe(String(process.getuid?.()))
    expect((await h.process.exec('pwd')).stdout).toBe(`${h.workspaceRoot}\n`)
    // The sandbox's processes see the mount; so does this host process, unless the
    // server is not root's: then the mount lives in that user's namespace, which the
    // processes enter (`casfs exec`) and this one does not.
    const inside = (await h.process.exec('cat /proc/self/mountinfo')).stdout
    expect(inside).toContain(` ${h.workspaceRoot} `)
    const here = execFileSync('cat', ['/proc/self/mountinfo'], { encoding: 'utf8' })
    const rootless = process.getuid?.() !== 0 && h.mode === 'overlay'
    expect(here.includes(` ${h.workspaceRoot} `)).toBe(!rootless)
    expect(await h.ports.connect(8123)).toEqual({ url: 'http://127.0.0.1:8123' })
    // Its kill reaches a background grandchild, a host process.
    const k = await h.process.spawn('sleep 60 & echo $!; wait')
    const pid = Number((await k.stdout[Symbol.asyncIterator]().next()).value)
    expect(alive(pid)).toBe(true)
    await h.destroy()
    expect(await k.wait()).toBeGreaterThan(128)
    for (let i = 0; i < 50 && alive(pid); i++) await sleep(50)
    expect(alive(pid)).toBe(false)
  })

  test('a bad isolation is refused by name', () => {
    expect(() =>
      casfsSandbox({ client: s.client, isolation: 'docker' as unknown as 'none' }),
    ).toThrow(/isolation docker/)
  })
})

describe('an agent host on another machine (loopback TCP with a token stands in)', () => {
  test('processes, files and snapshots go through the server alone', async () => {
    const port = await freePort()
    const tcp = await serve({ listen: { port, token: randomBytes(24).toString('hex') } })
    try {
      const remote = casfsSandbox({ client: tcp.client })
      const h = (await remote.create({ id: 'remote', env: { FROM: 'remote' } })) as CasfsSandboxHandle
      await h.fs.write('/workspace/in.txt', 'written remotely\n')
      const r = await h.process.exec('cat in.txt; echo "$FROM"; echo made > out.txt; id -u')
      expect(r.exitCode).toBe(0)
      const [a, b, uid] = r.stdout.trim().split('\n')
      expect([a, b]).toEqual(['written remotely', 'remote'])
      expect(uid).not.toBe('0')
      expect(await h.fs.read('/workspace/out.txt')).toBe('made\n')
      const p = await h.process.spawn('read x; echo "got $x"')
      await p.stdin.write('it\n')
      let out = ''
      for await (const c of p.stdout) out += c
      expect(out).toBe('got it\n')
      expect(await p.wait()).toBe(0)
      const snap = await h.snapshot!('remote')
      const back = (await remote.restoreSnapshot!({ snapshotId: snap.id })) as CasfsSandboxHandle
      expect((await back.process.exec('cat out.txt')).stdout).toBe('made\n')
      await back.destroy()
      await h.destroy()
    } finally {
      await tcp.cleanup()
    }
  })
})

describe('network policy: the server\'s allow-list, narrowed per sandbox', () => {
  test('a sandbox reaches what it was allowed through its proxy, and nothing else', async () => {
    let hits = 0
    const svc = httpServer((_req, res) => {
      hits++
      res.end('from the host\n')
    })
    await new Promise<void>((r) => svc.listen(0, '127.0.0.1', () => r()))
    const port = (svc.address() as { port: number }).port
    const net = await serve({ args: ['--sandbox-allow', `127.0.0.1:${port}`] })
    // Through the proxy (127.0.0.1 itself is the sandbox's own loopback).
    const get = `python3 -c 'import http.client as h; c = h.HTTPConnection("127.0.0.1", 3128, timeout=10); c.request("GET", "http://127.0.0.1:${port}/"); r = c.getresponse(); print(r.status, r.read().decode().strip())'`
    try {
      const allowed = casfsSandbox({ client: net.client, allowNetwork: [`127.0.0.1:${port}`] })
      expect(allowed.capabilities().networkPolicy).toBe(true)
      const a = await allowed.create({ id: 'net-allowed' })
      const r = await a.process.exec(`echo "$HTTPS_PROXY"; ${get}`)
      expect(r.stdout).toBe('http://127.0.0.1:3128\n200 from the host\n')
      // The framework's policy: deny takes only allowNetwork, none given here.
      const closed = casfsSandbox({ client: net.client })
      const c = await closed.create({ id: 'net-denied', policy: { capabilities: { network: 'deny' } } })
      const d = await c.process.exec(`echo "proxy=\${HTTPS_PROXY:-none}"; ${get}`)
      expect(d.stdout).toBe('proxy=none\n')
      expect(d.exitCode).not.toBe(0)
      // Allowed by policy: the server's whole list.
      const open = await closed.create({ id: 'net-open', policy: { capabilities: { network: 'allow' } } })
      expect((await open.process.exec(get)).stdout).toBe('200 from the host\n')
      expect(hits).toBe(2)
      // Never more than the server allows.
      const wider = casfsSandbox({ client: net.client, allowNetwork: ['example.com'] })
      await expect(wider.create({ id: 'net-wider' })).rejects.toThrow(/not within the server's allow-list/)
      for (const h of [a, c, open]) await h.destroy()
    } finally {
      await net.cleanup()
      svc.close()
    }
  })
})
