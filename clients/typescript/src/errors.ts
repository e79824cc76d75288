/**
 * Errors of the casfs client: every answer of `casfs serve` that is not a success is a
 * {@link CasfsError} carrying the server's error `kind` (see the Error schema of
 * docs/openapi.json); the checkpoint store adapter raises {@link SandboxCheckpointError}
 * with the codes an agent framework's snapshot middleware checks.
 */

/** The error kinds `casfs serve` answers with (docs/openapi.json, schema Error). */
export type CasfsErrorKind =
  | 'invalid'
  | 'unauthorized'
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
  | 'too_large'
  | 'unsupported_media_type'
  | 'policy'
  | 'too_many_runs'
  | 'too_many_sandboxes'
  | 'internal'
  | 'sandbox'
  | 'persistence'
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

/** The codes the snapshot middleware of an agent framework checks. */
export type SandboxCheckpointErrorCode =
  /** The head (or a checkpoint asked for) is not in the store. */
  | 'SANDBOX_SNAPSHOT_CHECKPOINT_NOT_FOUND'
  /** Another writer holds the thread's lease. */
  | 'SANDBOX_SNAPSHOT_LEASE_HELD'
  /** The lease expired, was taken over or released: this writer must not publish. */
  | 'SANDBOX_SNAPSHOT_LEASE_LOST'
  /** The thread's head is not the one the writer expected. */
  | 'SANDBOX_SNAPSHOT_HEAD_MISMATCH'
  /** Anything else; `cause` is the {@link CasfsError}. */
  | 'SANDBOX_SNAPSHOT_STORE_ERROR'

export class SandboxCheckpointError extends Error {
  override readonly name = 'SandboxCheckpointError'
  constructor(
    readonly code: SandboxCheckpointErrorCode,
    message: string,
    options?: { cause?: unknown },
  ) {
    super(message, options)
  }
}

/** The framework code of a server error. */
export function checkpointCode(e: CasfsError): SandboxCheckpointErrorCode {
  switch (e.kind) {
    case 'lease_held':
      return 'SANDBOX_SNAPSHOT_LEASE_HELD'
    case 'lease_lost':
    case 'lease_expired':
      return 'SANDBOX_SNAPSHOT_LEASE_LOST'
    case 'head_mismatch':
      return 'SANDBOX_SNAPSHOT_HEAD_MISMATCH'
    case 'not_found':
    case 'head_missing':
      return 'SANDBOX_SNAPSHOT_CHECKPOINT_NOT_FOUND'
    default:
      return 'SANDBOX_SNAPSHOT_STORE_ERROR'
  }
}

/** `e` as a {@link SandboxCheckpointError} (a server error gets its code; others pass). */
export function asCheckpointError(e: unknown): unknown {
  if (e instanceof CasfsError) {
    return new SandboxCheckpointError(checkpointCode(e), e.message, { cause: e })
  }
  return e
}
