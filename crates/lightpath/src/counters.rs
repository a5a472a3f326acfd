//! Counters an operator can read: the soft devices this process opened for its streams
//! ([`soft_device_stats`]), and — for `lightpath devices --stats`, which runs in another
//! process — the same numbers served on request.
//!
//! Serving: when the process opens its first soft device, a thread starts listening on the
//! abstract Unix socket `@lightpath-stats-<pid>` (per network namespace, gone with the
//! process, no file to clean up). A client that connects gets one text report and the
//! connection is closed; nothing is computed or written unless someone asks, so the data
//! path pays nothing. The report is lines of `device <name> <local address>` followed by
//! `<counter> <value>` lines for that device ([`write_report`], [`parse_report`]).
//! `LIGHTPATH_STATS_SOCKET=0` turns the socket off.

use std::io::{self, BufRead, Write};
use std::net::SocketAddr;

use lightpath_soft::{SoftDevice, SoftStats};

/// Prefix of the abstract socket names processes serve their counters on.
pub const STATS_SOCKET_PREFIX: &str = "lightpath-stats-";

/// One soft device of this process and its counters.
#[derive(Clone, Debug)]
pub struct SoftDeviceStats {
    /// The device's name (`soft:<address>`).
    pub name: String,
    /// The UDP address it is bound to.
    pub local: SocketAddr,
    /// Its engine's and driver's counters.
    pub stats: SoftStats,
}

/// The counters of every soft device this process opened for its streams (one per local
/// address; they are shared by all the streams that use it). Empty until a stream used the
/// soft provider.
pub fn soft_device_stats() -> Vec<SoftDeviceStats> {
    crate::devices::soft::open_devices().iter().map(snapshot).collect()
}

fn snapshot(device: &SoftDevice) -> SoftDeviceStats {
    use lightpath_verbs::Device as _;
    SoftDeviceStats { name: device.name().to_string(), local: device.local_addr(), stats: device.stats() }
}

/// Every counter of `stats` with its name, engine counters first.
pub fn named_counters(stats: &SoftStats) -> Vec<(&'static str, u64)> {
    let e = &stats.engine;
    let d = &stats.driver;
    vec![
        ("rx_datagrams", e.rx_datagrams),
        ("rx_bytes", e.rx_bytes),
        ("tx_datagrams", e.tx_datagrams),
        ("tx_bytes", e.tx_bytes),
        ("retransmits", e.retransmits),
        ("timeouts", e.timeouts),
        ("naks_sent", e.naks_sent),
        ("naks_received", e.naks_received),
        ("rnr_naks_sent", e.rnr_naks_sent),
        ("rnr_naks_received", e.rnr_naks_received),
        ("acks_sent", e.acks_sent),
        ("duplicates", e.duplicates),
        ("stale_responses", e.stale_responses),
        ("cq_overflows", e.cq_overflows),
        ("drops_icrc", e.drops_icrc),
        ("drops_malformed", e.drops_malformed),
        ("drops_unknown_qp", e.drops_unknown_qp),
        ("drops_bad_state", e.drops_bad_state),
        ("drops_wrong_peer", e.drops_wrong_peer),
        ("drops_unsupported", e.drops_unsupported),
        ("drops_unexpected_response", e.drops_unexpected_response),
        ("drops_out_of_sequence", e.drops_out_of_sequence),
        ("drops_stale_duplicate", e.drops_stale_duplicate),
        ("drops_responder_busy", e.drops_responder_busy),
        ("drops_oversized", d.drops_oversized),
        ("drops_bad_source", d.drops_bad_source),
        ("tx_errors", e.tx_errors + d.tx_errors),
        ("rx_errors", d.rx_errors),
        ("rx_batches", d.rx_batches),
        ("tx_batches", d.tx_batches),
        ("rx_coalesced", d.rx_coalesced),
        ("tx_segmented", d.tx_segmented),
        ("tx_bundles", d.tx_bundles),
        ("rx_bundles", e.rx_bundles),
        ("segmentation_failures", d.segmentation_failures),
        ("port_armings", d.port_armings),
        ("port_rescues", d.port_rescues),
        ("late_answers", d.late_answers),
    ]
}

/// Writes the report of `devices` (the format in the module docs).
pub fn write_report(devices: &[SoftDeviceStats], out: &mut impl Write) -> io::Result<()> {
    for device in devices {
        writeln!(out, "device {} {}", device.name, device.local)?;
        for (name, value) in named_counters(&device.stats) {
            writeln!(out, "{name} {value}")?;
        }
    }
    Ok(())
}

/// A device in a report read back: name, local address, counters in report order.
pub type ReportedDevice = (String, String, Vec<(String, u64)>);

/// Reads a report written by [`write_report`]; a line that fits neither form is an error.
pub fn parse_report(input: impl BufRead) -> io::Result<Vec<ReportedDevice>> {
    let bad = |line: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad stats line: {line:?}"));
    let mut devices: Vec<ReportedDevice> = Vec::new();
    for line in input.lines() {
        let line = line?;
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next(), words.next()) {
            (None, ..) => {}
            (Some("device"), Some(name), Some(local), None) => {
                devices.push((name.to_string(), local.to_string(), Vec::new()))
            }
            (Some(counter), Some(value), None, None) => {
                let value = value.parse().map_err(|_| bad(&line))?;
                devices.last_mut().ok_or_else(|| bad(&line))?.2.push((counter.to_string(), value));
            }
            _ => return Err(bad(&line)),
        }
    }
    Ok(devices)
}

/// Starts serving this process's counters (once; see the module docs). Failure to bind is
/// not an error for the caller: counters are a convenience, never a reason to fail a stream.
pub(crate) fn serve_once() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        if std::env::var_os("LIGHTPATH_STATS_SOCKET").is_some_and(|v| v == "0") {
            return;
        }
        let name = format!("{STATS_SOCKET_PREFIX}{}", std::process::id());
        let listener = match bind_abstract(&name) {
            Ok(listener) => listener,
            Err(err) => {
                tracing::debug!(socket = %name, error = %err, "counters socket not served");
                return;
            }
        };
        let spawned = std::thread::Builder::new().name("lightpath-stats".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_write_timeout(Some(std::time::Duration::from_secs(1)));
                let mut report = Vec::new();
                if write_report(&soft_device_stats(), &mut report).is_ok() {
                    let _ = conn.write_all(&report);
                }
            }
        });
        if let Err(err) = spawned {
            tracing::debug!(error = %err, "counters socket thread not started");
        }
    });
}

fn bind_abstract(name: &str) -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    std::os::unix::net::UnixListener::bind_addr(&addr)
}

/// Asks the process `pid` for its report (`lightpath devices --stats`).
pub fn fetch_report(pid: u32) -> io::Result<Vec<ReportedDevice>> {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("{STATS_SOCKET_PREFIX}{pid}");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let conn = std::os::unix::net::UnixStream::connect_addr(&addr)?;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
    parse_report(io::BufReader::new(conn))
}

/// The processes that serve counters in this network namespace (from `/proc/net/unix`).
pub fn serving_processes() -> io::Result<Vec<u32>> {
    let table = std::fs::read_to_string("/proc/net/unix")?;
    let marker = format!("@{STATS_SOCKET_PREFIX}");
    let mut pids: Vec<u32> = table
        .lines()
        .filter_map(|line| line.split_whitespace().last())
        .filter_map(|path| path.strip_prefix(&marker)?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_as_written() {
        let mut stats = SoftStats::default();
        stats.engine.rx_datagrams = 7;
        stats.engine.drops_icrc = 2;
        stats.driver.rx_errors = 1;
        let device = SoftDeviceStats {
            name: "soft:127.0.0.1".into(),
            local: "127.0.0.1:4791".parse().unwrap(),
            stats: stats.clone(),
        };
        let mut text = Vec::new();
        write_report(&[device.clone(), device], &mut text).unwrap();
        let parsed = parse_report(&text[..]).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].0, "soft:127.0.0.1");
        assert_eq!(parsed[0].1, "127.0.0.1:4791");
        let expected: Vec<(String, u64)> =
            named_counters(&stats).into_iter().map(|(n, v)| (n.to_string(), v)).collect();
        assert_eq!(parsed[1].2, expected);
        assert!(parsed[0].2.contains(&("drops_icrc".to_string(), 2)));
    }

    #[test]
    fn a_garbled_report_is_an_error() {
        assert!(parse_report(&b"rx_datagrams 1\n"[..]).is_err(), "a counter before any device");
        assert!(parse_report(&b"device a b\nrx_datagrams x\n"[..]).is_err());
        assert!(parse_report(&b"device a b c d\n"[..]).is_err());
    }
}
