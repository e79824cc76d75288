//! A run the server holds, by its id: reserved by a start still setting it up, or live
//! with its hooks' run, its file events and when a request last named it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::event_ring::EventRing;
use crate::middleware::lifecycle::Run;

/// A run id taken: the run is being set up, or going.
pub(super) enum RunSlot {
    /// Reserved by a start that has not returned yet (the id is taken atomically).
    Starting,
    Live(LiveRun),
}

pub(super) struct LiveRun {
    pub(super) run: Arc<Run>,
    pub(super) events: Arc<Mutex<EventRing>>,
    /// When a request last named the run.
    pub(super) seen: Mutex<Instant>,
}
