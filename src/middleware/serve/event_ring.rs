//! The last file events of a run or of a client's sandbox, numbered by the server from
//! 1 without gaps, and what a client that fell behind is told it lost.

use std::collections::VecDeque;

use serde_json::{json, Value};

use super::error::to_json;
use crate::middleware::events::FileEvent;

/// The last file events of a run, numbered by the server from 1 without gaps.
pub(super) struct EventRing {
    events: VecDeque<FileEvent>,
    /// The number the next event gets.
    next: u64,
    cap: usize,
}

impl EventRing {
    pub(super) fn new(cap: usize) -> EventRing {
        EventRing {
            events: VecDeque::new(),
            next: 1,
            cap: cap.max(1),
        }
    }

    pub(super) fn push(&mut self, e: &FileEvent) {
        let mut e = e.clone();
        e.event.seq = self.next;
        self.next += 1;
        if self.events.len() == self.cap {
            self.events.pop_front();
        }
        self.events.push_back(e);
    }

    /// The events numbered above `after`, led by a `lost` marker if some of them are
    /// no longer kept.
    pub(super) fn after(&self, after: u64) -> Vec<Value> {
        let oldest = self.events.front().map_or(self.next, |e| e.event.seq);
        let mut out = Vec::new();
        // `after` is the client's: any u64 (numbers are never above `next`, so one
        // beyond every event asks for none and loses none).
        if after < oldest.saturating_sub(1) {
            let (from, count) = (after + 1, oldest - after - 1);
            out.push(json!({
                "kind": "lost",
                "seq": from,
                "count": count,
                "message": format!(
                    "events lost from seq {from} to {}: the server keeps the last {} events \
                     of a run; read them more often",
                    oldest - 1,
                    self.cap
                ),
            }));
        }
        out.extend(
            self.events
                .iter()
                .filter(|e| e.event.seq > after)
                .map(to_json),
        );
        out
    }
}
