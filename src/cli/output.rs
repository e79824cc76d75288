//! Printing helpers: sizes, times, JSON, and a progress spinner that draws only on a
//! terminal.

use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.2} s", ms as f64 / 1000.0)
    }
}

pub fn time_ms(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(t).to_string()
}

pub fn json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Runs `work` with a spinner whose message `status` renders every 100 ms.
pub fn with_spinner<T>(
    label: &str,
    status: impl Fn() -> String + Sync,
    work: impl FnOnce() -> T,
) -> T {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {prefix} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_prefix(label.to_string());
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let result = std::thread::scope(|s| {
        let bar = &bar;
        let status = &status;
        s.spawn(move || {
            // Ends as soon as the work does (the sender is dropped), not a tick later.
            while let Err(RecvTimeoutError::Timeout) =
                done_rx.recv_timeout(Duration::from_millis(100))
            {
                bar.set_message(status());
                bar.tick();
            }
        });
        let r = work();
        drop(done_tx);
        r
    });
    bar.finish_and_clear();
    result
}
