/**
 * casfs for TypeScript agent hosts, and for TanStack AI's sandbox layer in particular:
 * `casfsSandbox()` is a sandbox provider whose sandboxes are casfs-mounted workspaces
 * (native snapshots are casfs checkpoints, a restore is a mount); `CasfsCheckpointStore`,
 * `CasfsMessageStore` and `CasfsInstanceStore` are the framework's portable checkpoint,
 * transcript and instance stores, durable in casfs's store. Also the typed client of
 * `casfs serve` and a way to run the server.
 */
export { CasfsClient, connect } from './client.js'
export type { CasfsApi, ConnectOptions, Schemas, components, paths } from './client.js'
export {
  CasfsError,
  SandboxCheckpointConflictError,
  SandboxCheckpointDuplicateIdError,
  SandboxCheckpointError,
  SandboxCheckpointInvalidEntryError,
  SandboxCheckpointInvalidIdError,
  SandboxCheckpointNotHeadError,
  SandboxCheckpointParentMismatchError,
  SandboxCheckpointWriterConflictError,
  SandboxCheckpointWriterLostError,
  UnsupportedCapabilityError,
  asCheckpointError,
} from './errors.js'
export type { CasfsErrorKind, SandboxCheckpointErrorCode } from './errors.js'
export {
  CasfsCheckpointStore,
  CasfsInstanceStore,
  CasfsMessageStore,
  casfsSnapshotStores,
} from './checkpoint-store.js'
export type { CasfsCheckpointStoreOptions } from './checkpoint-store.js'
export { casfsSandbox, WORKSPACE_ROOT } from './provider.js'
export type { CasfsSandboxHandle, CasfsSandboxOptions } from './provider.js'
export { lastEvent, sandboxEvents } from './events.js'
export type { EventsOptions, FileChange, FileEvent } from './events.js'
export { startCasfsServe } from './server.js'
export type { ServeOptions, Served } from './server.js'
export type * from './contracts.js'
