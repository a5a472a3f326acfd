//! A progress indicator on stderr for long runs; silent when stderr is not a terminal.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Redraws one status line at most a few times per second.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    label: String,
    total: u64,
    last_draw: Instant,
}

impl Progress {
    /// A progress line for `total` iterations labelled `label`.
    pub fn new(label: String, total: u64) -> Self {
        let enabled = std::io::stderr().is_terminal() && total >= 1000;
        Self { enabled, label, total, last_draw: Instant::now() }
    }

    /// Reports that `done` iterations have finished. Cheap when nothing needs drawing.
    #[inline]
    pub fn update(&mut self, done: u64) {
        if !self.enabled || done & 0xff != 0 {
            return;
        }
        let now = Instant::now();
        if now.duration_since(self.last_draw) < Duration::from_millis(200) {
            return;
        }
        self.last_draw = now;
        let pct = done as f64 * 100.0 / self.total.max(1) as f64;
        let _ = write!(std::io::stderr(), "\r{}: {done}/{} ({pct:.0}%)", self.label, self.total);
    }

    /// Clears the line.
    pub fn finish(&mut self) {
        if self.enabled {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}
