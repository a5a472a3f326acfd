//! `lightpath launch` and `lightpath perf <collective>` end to end: two ranks over shm, the
//! OSU-style table and JSON, and a failing rank's exit status passed on.

use std::process::Command;

fn lightpath() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lightpath"))
}

#[test]
fn launch_runs_perf_allreduce_as_two_ranks() {
    let bin = env!("CARGO_BIN_EXE_lightpath");
    let out = lightpath()
        .args(["launch", "-n", "2", "--", bin, "perf", "allreduce", "-s", "64K", "-n", "20"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("# lightpath perf allreduce: 2 ranks, f32, via rdma/shm"), "{text}");
    let row: Vec<&str> = text
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .expect("a row for 64 KiB")
        .split_whitespace()
        .collect();
    assert_eq!(row.len(), 6, "{text}");
    let avg: f64 = row[1].parse().unwrap();
    assert!(avg > 0.0, "{text}");
    for test in ["bcast", "reduce", "allgather", "reduce_scatter", "alltoall", "barrier"] {
        let line = perf_json_line(test, &["-s", "4K", "-n", "10"]);
        assert!(
            line.contains(&format!("\"test\":\"{test}\"")) && line.contains("\"verified\":true"),
            "{test}: {line}"
        );
    }
}

/// Runs `lightpath perf TEST ARGS... --json` as two ranks under `lightpath launch`; the first
/// line of its output, once the run succeeded.
fn perf_json_line(test: &str, args: &[&str]) -> String {
    let bin = env!("CARGO_BIN_EXE_lightpath");
    let out = lightpath()
        .args(["launch", "-n", "2", "--", bin, "perf", test])
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{test}: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines().next().unwrap_or_default().to_string()
}

#[test]
fn touched_runs_rewrite_the_data_and_still_verify() {
    // `--touch` rewrites each call's data before the call (the root's buffer for a broadcast);
    // the results must still check out, and the JSON says the run was touched.
    for test in ["allgather", "bcast", "allreduce"] {
        let line = perf_json_line(test, &["-s", "64K", "-n", "10", "--touch"]);
        assert!(line.contains("\"touched\":true") && line.contains("\"verified\":true"), "{test}: {line}");
    }
}

#[test]
fn launch_passes_on_a_failing_ranks_status() {
    let out =
        lightpath().args(["launch", "-n", "2", "--grace", "1", "--", "sh", "-c", "exit 7"]).output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("rank"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = lightpath().args(["launch", "-n", "1", "--", "/nonexistent/program"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/program"));
}
