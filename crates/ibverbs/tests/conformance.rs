//! The verbs conformance suite on a real RDMA device through libibverbs.
//!
//! Both ends of every case are queue pairs on one device (two contexts of it: loopback through
//! the NIC, or through rxe). Which device: `LIGHTPATH_IBV_DEVICE`, else the first one
//! libibverbs lists; GID index: `LIGHTPATH_IBV_GID_INDEX`, else chosen automatically.
//!
//! This is a test binary with its own small runner (`harness = false`) so that it can skip
//! every case with a printed reason where there is no libibverbs or no device, which is the
//! case on most build machines; `LIGHTPATH_IBV_REQUIRED=1` turns that into a failure (the VM
//! interop suite sets it). It prints libtest's lines (`test NAME ... ok`, `test result: ...`),
//! runs the cases one at a time, accepts a substring filter as its first argument, and
//! `--list` prints the case names.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use lightpath_ibverbs::{IbvConfig, IbvDevice, IbvProvider};
use lightpath_verbs::conformance::{cases, ConformanceFixture};
use lightpath_verbs::Provider;

struct OneDevice;

fn provider() -> IbvProvider {
    let gid_index = std::env::var("LIGHTPATH_IBV_GID_INDEX").ok().and_then(|text| text.parse().ok());
    IbvProvider::with_config(IbvConfig { port: None, gid_index })
}

fn open() -> Result<IbvDevice, String> {
    let provider = provider();
    match std::env::var("LIGHTPATH_IBV_DEVICE") {
        Ok(name) => provider.open(&name),
        Err(_) => provider.open_first(),
    }
    .map_err(|err| err.to_string())
}

impl ConformanceFixture for OneDevice {
    type Device = IbvDevice;

    fn open_pair() -> (IbvDevice, IbvDevice) {
        let a = open().expect("open the device (side A)");
        let b = open().expect("open the device (side B)");
        (a, b)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = cases::<OneDevice>();
    if args.iter().any(|a| a == "--list") {
        for (name, _) in &all {
            println!("{name}: test");
        }
        return;
    }
    let filter = args.iter().find(|a| !a.starts_with('-')).cloned();
    let selected: Vec<_> =
        all.iter().filter(|(name, _)| filter.as_deref().is_none_or(|f| name.contains(f))).collect();
    let required = std::env::var("LIGHTPATH_IBV_REQUIRED").is_ok_and(|v| v == "1");

    let device = match open() {
        Ok(device) => device,
        Err(reason) => {
            println!("running 0 tests: no RDMA device to test on: {reason}");
            if required {
                println!("test result: FAILED. 0 passed; 1 failed; 0 ignored (LIGHTPATH_IBV_REQUIRED=1)");
                std::process::exit(1);
            }
            println!(
                "test result: ok. 0 passed; 0 failed; {} ignored; 0 measured; 0 filtered out",
                selected.len()
            );
            return;
        }
    };
    let source = device.source_gid();
    println!(
        "ibverbs conformance on {} port {} GID index {} ({}, {})",
        lightpath_verbs::Device::name(&device),
        device.port(),
        source.index,
        source.gid,
        source.kind
    );
    drop(device);
    println!("running {} tests", selected.len());
    let start = Instant::now();
    let mut failed = Vec::new();
    for (name, case) in &selected {
        let begun = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(case));
        let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
        println!("test {name} ... {verdict} ({:.2}s)", begun.elapsed().as_secs_f64());
        if outcome.is_err() {
            failed.push(*name);
        }
    }
    let passed = selected.len() - failed.len();
    let filtered = all.len() - selected.len();
    if failed.is_empty() {
        println!(
            "test result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; {filtered} filtered out; finished in {:.2}s",
            start.elapsed().as_secs_f64()
        );
    } else {
        println!("failures: {}", failed.join(", "));
        println!(
            "test result: FAILED. {passed} passed; {} failed; 0 ignored; 0 measured; {filtered} filtered out; finished in {:.2}s",
            failed.len(),
            start.elapsed().as_secs_f64()
        );
        std::process::exit(101);
    }
}
