//! casfs: a content-addressed workspace filesystem for agent sandboxes.
//!
//! Layers, lowest first: [`cas`] (objects, chunks, trees), [`fs`] (the FUSE
//! filesystem), [`checkpoint`] (checkpoint records, threads, heads, writer leases,
//! plain-directory capture and restore), and the command line in `cli`. A layer never
//! reaches up.

pub mod cas;
pub mod checkpoint;
pub mod fs;
pub mod middleware;
