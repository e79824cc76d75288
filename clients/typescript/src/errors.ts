/**
 * Errors of the casfs client. Every answer of `casfs serve` that is not a success is a
 * {@link CasfsError} carrying the server's error `kind` (the Error schema of
 * docs/openapi.json). The checkpoint store raises the framework's own errors: a
 * {@link SandboxCheckpointError} whose `code` is the framework's (and the subclass the
 * framework throws for it), so a host tells the cases apart exactly as it does with
 * the framework's reference store.
 */

/** The error kinds `casfs serve` answers with (docs/openapi.json, schema Error). */
export type CasfsErrorKind =
  | 'invalid'
  | 'unauthorized'
  | 'forbidden'
  | 'not_found'
  | 'method_not_allowed'
  | 'run_exists'
  | 'run_starting'
  | 'lease_held'
  | 'lease_lost'
  | 'lease_expired'
  | 'head_mismatch'
  | 'head_missing'
  | 'workspace_mismatch'
  | 'thread_exists'
  | 'cancelled'
  | 'sandbox_busy'
  | 'wrong_thread'
  | 'request_timeout'
  | 'too_large'
  | 'uri_too_long'
  | 'unsupported_media_type'
  | 'policy'
  | 'too_many_runs'
  | 'too_many_sandboxes'
  | 'headers_too_large'
  | 'internal'
  | 'sandbox'
  | 'persistence'
  | 'too_many_connections'
  | 'busy'
  | 'invalid_id'
  | 'invalid_entry'
  | 'no_store'
  | 'store_exists'
  | 'stale_head'
  | 'parent_mismatch'
  | 'duplicate_id'
  | 'not_head'
  | 'writer_conflict'
  | 'writer_lost'
  | 'fork_source_not_found'
  | 'fork_source_thread_mismatch'
  | 'fork_destination_not_empty'
  /** No answer at all: the server is not running, the socket is wrong. */
  | 'unreachable'
  /** An answer that is not the API's JSON. */
  | 'bad_response'

/** A refused or failed request to `casfs serve`. */
export class CasfsError extends Error {
  override readonly name = 'CasfsError'
  constructor(
    /** The server's error kind. */
    readonly kind: CasfsErrorKind,
    message: string,
    /** The HTTP status (0 when the server was not reached). */
    readonly status: number,
    /** `METHOD path` of the request. */
    readonly request: string,
    options?: { cause?: unknown },
  ) {
    super(`${request}: ${message} (${kind})`, options)
  }
}

/** The framework's checkpoint error codes. */
export type SandboxCheckpointErrorCode =
  | 'SANDBOX_SNAPSHOT_STALE_HEAD'
  | 'SANDBOX_SNAPSHOT_PARENT_MISMATCH'
  | 'SANDBOX_SNAPSHOT_DUPLICATE_ID'
  | 'SANDBOX_SNAPSHOT_NOT_HEAD'
  | 'SANDBOX_SNAPSHOT_WRITER_CONFLICT'
  | 'SANDBOX_SNAPSHOT_WRITER_LOST'
  | 'SANDBOX_SNAPSHOT_INVALID_ID'
  | 'SANDBOX_SNAPSHOT_INVALID_ENTRY'
  | 'SANDBOX_SNAPSHOT_CHECKPOINT_NOT_FOUND'
  | 'SANDBOX_SNAPSHOT_ATOMIC_FORK_REQUIRED'
  | 'SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND'
  | 'SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH'
  | 'SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY'

export class SandboxCheckpointError extends Error {
  override name = 'SandboxCheckpointError'
  constructor(
    readonly code: SandboxCheckpointErrorCode,
    message: string,
    options?: { cause?: unknown },
  ) {
    super(message, options)
  }
}

/** The thread's head is not the one the writer expected. */
export class SandboxCheckpointConflictError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_STALE_HEAD', message, options)
    this.name = 'SandboxCheckpointConflictError'
  }
}

export class SandboxCheckpointDuplicateIdError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_DUPLICATE_ID', message, options)
    this.name = 'SandboxCheckpointDuplicateIdError'
  }
}

export class SandboxCheckpointInvalidIdError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_INVALID_ID', message, options)
    this.name = 'SandboxCheckpointInvalidIdError'
  }
}

export class SandboxCheckpointInvalidEntryError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_INVALID_ENTRY', message, options)
    this.name = 'SandboxCheckpointInvalidEntryError'
  }
}

export class SandboxCheckpointParentMismatchError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_PARENT_MISMATCH', message, options)
    this.name = 'SandboxCheckpointParentMismatchError'
  }
}

export class SandboxCheckpointNotHeadError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_NOT_HEAD', message, options)
    this.name = 'SandboxCheckpointNotHeadError'
  }
}

export class SandboxCheckpointWriterConflictError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_WRITER_CONFLICT', message, options)
    this.name = 'SandboxCheckpointWriterConflictError'
  }
}

export class SandboxCheckpointWriterLostError extends SandboxCheckpointError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('SANDBOX_SNAPSHOT_WRITER_LOST', message, options)
    this.name = 'SandboxCheckpointWriterLostError'
  }
}

/** The framework's error for a server refusal, or the {@link CasfsError} itself. */
export function asCheckpointError(e: unknown): unknown {
  if (!(e instanceof CasfsError)) return e
  const opts = { cause: e }
  const m = e.message
  switch (e.kind) {
    case 'stale_head':
      return new SandboxCheckpointConflictError(m, opts)
    case 'parent_mismatch':
      return new SandboxCheckpointParentMismatchError(m, opts)
    case 'duplicate_id':
      return new SandboxCheckpointDuplicateIdError(m, opts)
    case 'not_head':
      return new SandboxCheckpointNotHeadError(m, opts)
    case 'writer_conflict':
      return new SandboxCheckpointWriterConflictError(m, opts)
    case 'writer_lost':
      return new SandboxCheckpointWriterLostError(m, opts)
    case 'invalid_id':
      return new SandboxCheckpointInvalidIdError(m, opts)
    case 'invalid_entry':
      return new SandboxCheckpointInvalidEntryError(m, opts)
    case 'fork_source_not_found':
      return new SandboxCheckpointError('SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND', m, opts)
    case 'fork_source_thread_mismatch':
      return new SandboxCheckpointError('SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH', m, opts)
    case 'fork_destination_not_empty':
      return new SandboxCheckpointError('SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY', m, opts)
    default:
      return e
  }
}

/**
 * An optional capability that a sandbox does not have (the framework's
 * `UnsupportedCapabilityError` shape): thrown, never a silent no-op.
 */
export class UnsupportedCapabilityError extends Error {
  override readonly name = 'UnsupportedCapabilityError'
  constructor(
    readonly provider: string,
    readonly capability: string,
    hint?: string,
  ) {
    super(`${provider} does not support ${capability}${hint ? `: ${hint}` : ''}`)
  }
}
