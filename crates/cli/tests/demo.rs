//! `lightpath demo --no-bench`, the README's main command without its measurements: every
//! operation and every stream case reports `[ok]`, and the streams got the transports the
//! negotiation should pick on one host.

use std::process::Command;

#[test]
fn demo_runs_every_operation_and_stream_case() {
    let out = Command::new(env!("CARGO_BIN_EXE_lightpath")).args(["demo", "--no-bench"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for step in [
        "connect",
        "SEND",
        "RDMA WRITE with imm",
        "RDMA READ",
        "ATOMIC CMP_SWAP",
        "ATOMIC FETCH_ADD",
        "bad rkey refused",
    ] {
        assert!(text.lines().any(|l| l.starts_with(&format!("  [ok] {step} "))), "no [ok] {step}:\n{text}");
    }
    let stream =
        |name: &str| text.lines().find(|l| l.starts_with(&format!("  [ok] {name} "))).map(str::to_owned);
    let defaults = stream("default providers").expect("default providers line");
    assert!(defaults.contains("rdma/shm") && defaults.contains("matches"), "{defaults}");
    let soft = stream("soft only").expect("soft line");
    assert!(soft.contains("rdma/soft") && soft.contains("matches"), "{soft}");
    let tcp = stream("TCP only").expect("tcp line");
    assert!(tcp.contains("tcp (fallback") && tcp.contains("matches"), "{tcp}");
}

/// The measurements with few iterations: the verbs rows and the stream rows (shm and soft
/// against TCP, default options, two processes each) all print a value and their ratios.
#[test]
fn demo_side_by_side_covers_every_transport() {
    let out = Command::new(env!("CARGO_BIN_EXE_lightpath"))
        .args(["demo", "--lat-iters", "100", "--bw-iters", "32"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let header = text.lines().find(|l| l.contains("shm/TCP")).expect("stream table header");
    assert!(header.contains("soft/TCP") && header.contains("kernel TCP"), "{header}");
    for row in ["stream_lat 8 B (median)", "stream_bw 64 KiB", "stream_bw 1 MiB", "stream_rr 64 B, 16 conns"]
    {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(row))
            .unwrap_or_else(|| panic!("no {row}:\n{text}"));
        // Three values and two ratios, each a positive number.
        let ratios: Vec<f64> =
            line.split_whitespace().filter_map(|w| w.strip_suffix('x')).map(|w| w.parse().unwrap()).collect();
        assert_eq!(ratios.len(), 2, "{line}");
        assert!(ratios.iter().all(|r| *r > 0.0 && r.is_finite()), "{line}");
    }
    assert!(text.lines().any(|l| l.trim_start().starts_with("send_lat 8 B (median)")), "{text}");
}
