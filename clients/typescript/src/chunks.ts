/**
 * A process's output stream as the provider hands it out: an async iterable of text
 * chunks in the order they came, buffered (a reader that falls behind never stalls the
 * process), each iterator from the start, and the whole text once it ended.
 */
export class Chunks implements AsyncIterable<string> {
  private readonly chunks: string[] = []
  private ended = false
  private waiters: Array<() => void> = []
  private readonly decoder = new TextDecoder('utf-8')

  /** The chunks of a Node stream (none: an ended one). */
  static of(stream: NodeJS.ReadableStream | null): Chunks {
    const c = new Chunks()
    if (!stream) {
      c.end()
      return c
    }
    stream.setEncoding('utf8')
    stream.on('data', (d: string) => c.push(d))
    const end = (): void => c.end()
    stream.on('end', end)
    stream.on('close', end)
    stream.on('error', end)
    return c
  }

  /** Appends text, or bytes decoded as UTF-8 (a character split across calls whole). */
  push(data: string | Uint8Array): void {
    const s = typeof data === 'string' ? data : this.decoder.decode(data, { stream: true })
    if (s !== '') {
      this.chunks.push(s)
      this.wake()
    }
  }

  end(): void {
    if (this.ended) return
    const rest = this.decoder.decode()
    if (rest !== '') this.chunks.push(rest)
    this.ended = true
    this.wake()
  }

  private wake(): void {
    const w = this.waiters
    this.waiters = []
    for (const f of w) f()
  }

  text(): string {
    return this.chunks.join('')
  }

  async *[Symbol.asyncIterator](): AsyncIterator<string> {
    let i = 0
    for (;;) {
      if (i < this.chunks.length) {
        yield this.chunks[i++] as string
        continue
      }
      if (this.ended) return
      await new Promise<void>((r) => this.waiters.push(r))
    }
  }
}
