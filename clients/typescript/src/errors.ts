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

/** A framework error with a fixed code, as a subclass of its own name. */
type CodedErrorClass = new (message: string, options?: { cause?: unknown }) => SandboxCheckpointError

function coded(code: SandboxCheckpointErrorCode, name: string): CodedErrorClass {
  return class extends SandboxCheckpointError {
    constructor(message: string, options?: { cause?: unknown }) {
      super(code, message, options)
      this.name = name
    }
  }
}

/** The thread's head is not the one the writer expected. */
export const SandboxCheckpointConflictError = coded('SANDBOX_SNAPSHOT_STALE_HEAD', 'SandboxCheckpointConflictError')
export const SandboxCheckpointDuplicateIdError = coded('SANDBOX_SNAPSHOT_DUPLICATE_ID', 'SandboxCheckpointDuplicateIdError')
export const SandboxCheckpointInvalidIdError = coded('SANDBOX_SNAPSHOT_INVALID_ID', 'SandboxCheckpointInvalidIdError')
export const SandboxCheckpointInvalidEntryError = coded('SANDBOX_SNAPSHOT_INVALID_ENTRY', 'SandboxCheckpointInvalidEntryError')
export const SandboxCheckpointParentMismatchError = coded('SANDBOX_SNAPSHOT_PARENT_MISMATCH', 'SandboxCheckpointParentMismatchError')
export const SandboxCheckpointNotHeadError = coded('SANDBOX_SNAPSHOT_NOT_HEAD', 'SandboxCheckpointNotHeadError')
export const SandboxCheckpointWriterConflictError = coded('SANDBOX_SNAPSHOT_WRITER_CONFLICT', 'SandboxCheckpointWriterConflictError')
export const SandboxCheckpointWriterLostError = coded('SANDBOX_SNAPSHOT_WRITER_LOST', 'SandboxCheckpointWriterLostError')

/**
 * What each server refusal becomes: the framework's subclass for it, or a
 * {@link SandboxCheckpointError} with the code (the fork errors have no subclass).
 */
const FOR_KIND: Partial<Record<CasfsErrorKind, CodedErrorClass | SandboxCheckpointErrorCode>> = {
  stale_head: SandboxCheckpointConflictError,
  parent_mismatch: SandboxCheckpointParentMismatchError,
  duplicate_id: SandboxCheckpointDuplicateIdError,
  not_head: SandboxCheckpointNotHeadError,
  writer_conflict: SandboxCheckpointWriterConflictError,
  writer_lost: SandboxCheckpointWriterLostError,
  invalid_id: SandboxCheckpointInvalidIdError,
  invalid_entry: SandboxCheckpointInvalidEntryError,
  fork_source_not_found: 'SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND',
  fork_source_thread_mismatch: 'SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH',
  fork_destination_not_empty: 'SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY',
}

/** The framework's error for a server refusal, or the {@link CasfsError} itself. */
export function asCheckpointError(e: unknown): unknown {
  if (!(e instanceof CasfsError)) return e
  const to = FOR_KIND[e.kind]
  const opts = { cause: e }
  if (to === undefined) return e
  if (typeof to === 'string') return new SandboxCheckpointError(to, e.message, opts)
  return new to(e.message, opts)
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
