//! What the library tells the user: one line per connection when it closes (and for those
//! still open when the program exits), saying which transport it ended on and why, with byte
//! counts per transport. Written to the file `LIGHTPATH_PRELOAD_REPORT` names (`stderr` for
//! the standard error), appended one whole line per write; nothing when it is unset.

use std::io::Write;
use std::sync::OnceLock;

fn target() -> Option<&'static str> {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    TARGET.get_or_init(|| std::env::var("LIGHTPATH_PRELOAD_REPORT").ok().filter(|v| !v.is_empty())).as_deref()
}

/// Reads the environment (at load, before a program can clear it).
pub(crate) fn init() {
    let _ = target();
    debug(format_args!("loaded"));
}

/// Writes one report line (prefixed with the program's pid), if reporting is on.
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    let Some(target) = target() else { return };
    let text = format!("lightpath-preload pid={} {}\n", crate::conn::pid(), args);
    if target == "stderr" {
        let _ = std::io::stderr().write_all(text.as_bytes());
        return;
    }
    if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(target) {
        let _ = file.write_all(text.as_bytes());
    }
}

/// A line for `LIGHTPATH_PRELOAD_DEBUG=1` runs (switch points and the like), stamped with the
/// milliseconds since the library loaded.
pub(crate) fn debug(args: std::fmt::Arguments<'_>) {
    static ON: OnceLock<bool> = OnceLock::new();
    static LOADED: OnceLock<std::time::Instant> = OnceLock::new();
    let loaded = *LOADED.get_or_init(std::time::Instant::now);
    if *ON.get_or_init(|| std::env::var("LIGHTPATH_PRELOAD_DEBUG").is_ok_and(|v| v == "1")) {
        line(format_args!("t={:.3}ms {args}", loaded.elapsed().as_secs_f64() * 1e3));
    }
}
