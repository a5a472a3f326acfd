//! End-to-end tests of `lightpath sim`: the JSON report of a clean run and of a black-hole
//! link, the exit codes, and tracing.

use std::process::{Command, Output};

use serde_json::Value;

fn lightpath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lightpath")).args(args).output().expect("run lightpath")
}

fn json_of(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.lines().count(), 1, "--json prints exactly one line: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[test]
fn clean_run_passes_every_seed_and_reports_counts() {
    let output = lightpath(&["sim", "--seeds", "12", "--seed-start", "100", "--json"]);
    assert_eq!(output.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    let report = json_of(&output);
    assert_eq!(report["seeds"], 12);
    assert_eq!(report["passed"], 12);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["failures"], Value::Array(Vec::new()));
    let ops = report["ops"].as_object().expect("ops object");
    let posted: u64 = ops.values().map(|c| c["posted"].as_u64().unwrap()).sum();
    let passed: u64 = ops.values().map(|c| c["passed"].as_u64().unwrap()).sum();
    assert!(posted > 12, "a dozen seeds post more than a dozen requests");
    assert_eq!(passed, posted);
    assert!(ops.values().map(|c| c["succeeded"].as_u64().unwrap()).sum::<u64>() > 0);
    assert!(report["goodput_bytes_per_sec"].as_f64().unwrap() > 0.0);
    assert_eq!(report["stats"]["packets_dropped"], 0);
    assert_eq!(report["stats"]["retry_exhausted"], 0);
}

#[test]
fn total_loss_ends_in_retry_exceeded_and_passes() {
    let output = lightpath(&["sim", "--seeds", "4", "--loss", "1.0", "--json"]);
    assert_eq!(output.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    let report = json_of(&output);
    assert_eq!(report["passed"], 4);
    assert_eq!(report["failed"], 0);
    // Both directions of every seed's connection give up exactly once; the rest is flushed.
    assert_eq!(report["stats"]["retry_exhausted"], 8);
    assert_eq!(report["stats"]["bytes_delivered"], 0);
    assert_eq!(report["stats"]["packets_delivered"], 0);
    let ops = report["ops"].as_object().expect("ops object");
    assert!(ops.values().all(|c| c["succeeded"] == 0));
}

#[test]
fn op_filter_mtu_and_text_output() {
    let output =
        lightpath(&["sim", "--seeds", "3", "--ops", "read,fetch_add", "--mtu", "256", "--loss", "0.05"]);
    assert_eq!(output.status.code(), Some(0));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("MTU 256"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("read ")), "{text}");
    assert!(!text.lines().any(|l| l.starts_with("send ")), "{text}");
    assert!(text.contains("goodput:"));
    assert!(text.trim_end().ends_with("seeds: 3 passed, 0 failed"), "{text}");
}

#[test]
fn trace_prints_the_datagrams_of_one_seed() {
    let output = lightpath(&["sim", "--trace", "7", "--loss", "0.1", "--json"]);
    let report = json_of(&output);
    assert_eq!(report["seeds"], 1);
    let trace = report["trace"].as_array().expect("trace array");
    assert!(trace.iter().any(|l| l.as_str().unwrap().contains("deliver")));
    assert!(trace.iter().any(|l| l.as_str().unwrap().contains("DROP(Loss)")));
}

#[test]
fn invalid_options_are_refused() {
    assert_eq!(lightpath(&["sim", "--loss", "1.5"]).status.code(), Some(2));
    assert_eq!(lightpath(&["sim", "--mtu", "1500"]).status.code(), Some(2));
    assert_eq!(lightpath(&["sim", "--ops", "teleport"]).status.code(), Some(2));
}

#[test]
fn batched_receive_option_is_applied_and_reported() {
    let output = lightpath(&["sim", "--seeds", "6", "--receive-batch-us", "10", "--negative", "1", "--json"]);
    assert_eq!(output.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    let report = json_of(&output);
    assert_eq!(report["passed"], 6);
    assert_eq!(report["config"]["receive_batch_us"], 10);
    assert_eq!(report["config"]["negative"], 1.0);
    let negatives: u64 =
        report["ops"].as_object().unwrap().values().map(|c| c["negative"].as_u64().unwrap()).sum();
    assert!(negatives > 0);
}
