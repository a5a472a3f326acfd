//! The `ibverbs` provider from the command line on a machine where it cannot run: the binary
//! starts without libibverbs (it is loaded at run time only), says why the provider is
//! unavailable, and every other provider keeps working. `LIGHTPATH_IBVERBS_LIB` points the
//! loader at a file that does not exist, so these tests behave the same on machines with and
//! without rdma-core. (The provider itself is tested on rxe by `interop/run-suite.sh`.)

use std::process::{Command, Output};

const MISSING: &str = "/nonexistent/lightpath-test/libibverbs.so.1";

fn lightpath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lightpath"))
        .args(args)
        .env("LIGHTPATH_IBVERBS_LIB", MISSING)
        .output()
        .expect("run lightpath")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn devices_explains_a_missing_libibverbs_and_lists_the_rest() {
    let out = lightpath(&["devices"]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    let line = stdout.lines().find(|l| l.starts_with("ibverbs:")).expect("an ibverbs line");
    assert!(line.starts_with("ibverbs: unavailable: "), "{line}");
    assert!(line.contains(&format!("{MISSING} was not found")), "{line}");
    assert!(line.contains("libibverbs1"), "the install hint is missing: {line}");
    assert!(stdout.lines().any(|l| l == "soft: available"), "{stdout}");

    let json = lightpath(&["devices", "--json"]);
    let reports: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    let ibverbs = reports
        .as_array()
        .and_then(|all| all.iter().find(|r| r["provider"] == "ibverbs"))
        .expect("an ibverbs report");
    assert_eq!(ibverbs["available"], false);
    assert!(ibverbs["reason"].as_str().is_some_and(|r| r.contains("was not found")), "{ibverbs}");
}

#[test]
fn tools_refuse_with_the_reason_and_exit_code_2() {
    let runs: [&[&str]; 3] = [
        &["pingpong", "--provider", "ibverbs", "-n", "1", "--timeout", "2"],
        &["interop-peer", "--provider", "ibverbs", "-n", "1", "-t", "2"],
        &["perf", "send_lat", "--provider", "ibverbs", "127.0.0.1", "-p", "9"],
    ];
    for args in runs {
        let out = lightpath(args);
        let all = text(&out.stdout) + &text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {all}");
        if args[0] != "perf" {
            // perf meets its server first (nobody listens on port 9 here): that error is enough.
            assert!(all.contains(&format!("{MISSING} was not found")), "{args:?}: {all}");
        }
    }
}

#[test]
fn soft_placement_options_are_refused_for_ibverbs() {
    for tool in ["pingpong", "interop-peer"] {
        let out = lightpath(&[tool, "--provider", "ibverbs", "--bind", "127.0.0.1"]);
        let all = text(&out.stdout) + &text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{tool}: {all}");
        assert!(all.contains("--bind and --udp-port place a soft device"), "{tool}: {all}");
    }
}
