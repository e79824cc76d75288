/**
 * casfs for TypeScript agent hosts: a typed client of `casfs serve`, a checkpoint
 * store adapter shaped like an agent framework's (writer leases, heads, CAS appends),
 * a sandbox provider of casfs-mounted workspaces, and a way to run the server.
 */
export { CasfsClient, connect } from './client.js'
export type { CasfsApi, ConnectOptions, Schemas, components, paths } from './client.js'
export {
  CasfsError,
  SandboxCheckpointError,
  asCheckpointError,
  checkpointCode,
} from './errors.js'
export type { CasfsErrorKind, SandboxCheckpointErrorCode } from './errors.js'
export { CasfsCheckpointStore, CasfsWriterLease } from './checkpoint-store.js'
export type {
  AcquireOptions,
  Appended,
  Checkpoint,
  CheckpointInput,
  Lease,
} from './checkpoint-store.js'
export { CasfsSandbox, CasfsSandboxProvider } from './sandbox.js'
export type { EventsOptions, FileChange, FileEvent } from './sandbox.js'
export { startCasfsServe } from './server.js'
export type { ServeOptions, Served } from './server.js'
