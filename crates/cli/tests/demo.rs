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
