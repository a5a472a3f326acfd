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
                selected.len() + 5 /* the cases after the suite need a device too */
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
    let device_name = lightpath_verbs::Device::name(&device).to_string();
    drop(device);
    let leaks = leak_check_baseline(&device_name);
    // Cases the device is known to fail for reasons of its own (LIGHTPATH_IBV_KNOWN_DEVIATIONS,
    // comma separated): still run, their failure printed, counted apart from real failures.
    let known_deviations: Vec<String> = std::env::var("LIGHTPATH_IBV_KNOWN_DEVIATIONS")
        .map(|list| list.split(',').map(|name| name.trim().to_string()).filter(|n| !n.is_empty()).collect())
        .unwrap_or_default();
    let mut extra: Vec<(&'static str, fn())> = vec![
        ("bad_device_name", bad_device_name as fn()),
        ("gid_index_out_of_range", gid_index_out_of_range),
        ("region_too_large", region_too_large),
        ("registered_vec_takes_rdma", registered_vec_takes_rdma),
        ("notify_fd_wakes_poll", notify_fd_wakes_poll),
    ];
    extra.retain(|(name, _)| filter.as_deref().is_none_or(|f| name.contains(f)));
    let total = selected.len() + extra.len();
    println!(
        "running {total} tests{}",
        if leaks.is_some() { " (checking `rdma resource` after each)" } else { "" }
    );
    let start = Instant::now();
    let mut failed = Vec::new();
    let mut expected_failures = Vec::new();
    for (name, case) in selected.iter().map(|(n, c)| (n, c)).chain(extra.iter().map(|(n, c)| (n, c))) {
        let begun = Instant::now();
        let mut outcome = catch_unwind(AssertUnwindSafe(case)).is_ok();
        if let (true, Some(baseline)) = (outcome, &leaks) {
            let now = resource_counts(&device_name);
            if now.as_ref() != Some(baseline) {
                println!("{name}: kernel objects left behind: before {baseline:?}, after {now:?}");
                outcome = false;
            }
        }
        let known = known_deviations.iter().any(|k| k == *name);
        let verdict = match (outcome, known) {
            (true, false) => "ok",
            (true, true) => "ok (listed as a known deviation of this device, but it passed)",
            (false, true) => "FAILED as expected (known deviation of this device, see the panic above)",
            (false, false) => "FAILED",
        };
        println!("test {name} ... {verdict} ({:.2}s)", begun.elapsed().as_secs_f64());
        match (outcome, known) {
            (false, false) => failed.push(*name),
            (false, true) => expected_failures.push(*name),
            _ => {}
        }
    }
    let all_len = all.len() + 5;
    let passed = total - failed.len() - expected_failures.len();
    if !expected_failures.is_empty() {
        println!(
            "known deviations of this device (failed as listed in LIGHTPATH_IBV_KNOWN_DEVIATIONS): {}",
            expected_failures.join(", ")
        );
    }
    let filtered = all_len - total;
    if failed.is_empty() {
        println!(
            "test result: ok. {passed} passed; 0 failed; {} ignored; 0 measured; {filtered} filtered out; finished in {:.2}s",
            expected_failures.len(),
            start.elapsed().as_secs_f64()
        );
    } else {
        println!("failures: {}", failed.join(", "));
        println!(
            "test result: FAILED. {passed} passed; {} failed; {} ignored; 0 measured; {filtered} filtered out; finished in {:.2}s",
            failed.len(),
            expected_failures.len(),
            start.elapsed().as_secs_f64()
        );
        std::process::exit(101);
    }
}

/// `rdma resource show DEVICE` as (kind, count) pairs (pd, cq, qp, mr, ctx, …), when the `rdma`
/// tool is there and `LIGHTPATH_IBV_LEAK_CHECK=1` asks for the check.
fn leak_check_baseline(device: &str) -> Option<Vec<(String, u64)>> {
    if !std::env::var("LIGHTPATH_IBV_LEAK_CHECK").is_ok_and(|v| v == "1") {
        return None;
    }
    let counts = resource_counts(device);
    match &counts {
        Some(counts) => println!("rdma resource {device} before: {counts:?}"),
        None => println!("leak check off: `rdma resource show {device}` did not work"),
    }
    counts
}

fn resource_counts(device: &str) -> Option<Vec<(String, u64)>> {
    let output = std::process::Command::new("rdma").args(["resource", "show", device]).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let words: Vec<&str> = text.split_whitespace().collect();
    let counts: Vec<(String, u64)> = words
        .windows(2)
        .filter_map(|pair| pair[1].parse().ok().map(|n| (pair[0].to_string(), n)))
        .filter(|(kind, _)| kind.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    (output.status.success() && !counts.is_empty()).then_some(counts)
}

/// A device name that does not exist is refused with the names that do.
fn bad_device_name() {
    let err = provider().open("no-such-device0").expect_err("a device that does not exist");
    let text = err.to_string();
    assert!(text.contains("no RDMA device named \"no-such-device0\"") && text.contains("lists:"), "{text}");
}

/// A GID index beyond the table is refused when the device is opened, naming the valid range.
fn gid_index_out_of_range() {
    let name = lightpath_verbs::Device::name(&open().expect("device")).to_string();
    let provider = IbvProvider::with_config(IbvConfig { port: None, gid_index: Some(100_000) });
    let err = provider.open(&name).expect_err("GID index 100000");
    let text = err.to_string();
    assert!(text.contains("GID index 100000 is out of range"), "{text}");
    let port_err = IbvProvider::with_config(IbvConfig { port: Some(9), gid_index: None })
        .open(&name)
        .expect_err("port 9");
    assert!(port_err.to_string().contains("no port 9"), "{port_err}");
}

/// A region far larger than memory is refused with a reason, and the device stays usable.
fn region_too_large() {
    use lightpath_verbs::{AccessFlags, Device, MemoryRegion, ProtectionDomain};
    let device = open().expect("device");
    let pd = device.alloc_pd().expect("pd");
    let err = pd.alloc_mr(1 << 46, AccessFlags::LOCAL_WRITE).expect_err("a 64 TiB region");
    let text = err.to_string();
    assert!(text.contains("70368744177664 bytes"), "{text}");
    let small = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("a small region afterwards");
    assert_eq!(small.len(), 4096);
}

/// Application memory moved in with `reg_vec` is registered (in place, or copied where fork
/// safety demands it) and takes a peer's RDMA WRITE and READ like any region.
fn registered_vec_takes_rdma() {
    use lightpath_verbs::conformance::harness::{pattern, read_region, Pair};
    use lightpath_verbs::{AccessFlags, MemoryRegion, ProtectionDomain, QueuePair, SendOp, SendWr, WcOpcode};
    let pair = Pair::connected::<OneDevice>();
    let initial = pattern(8192, 3);
    let target = pair.b.pd.reg_vec(initial.clone(), AccessFlags::ALL).expect("reg_vec");
    assert_eq!((target.len(), read_region(&target, 0, 8192)), (8192, initial.clone()));
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(4096, 9)).expect("fill");
    let remote = target.remote();
    let op = SendOp::Write { remote_addr: remote.addr + 1000, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::new(1, op, &[src.sge(0, 4096)])).expect("post write");
    let wc = pair.a.wait_one();
    assert_eq!((wc.wr_id, wc.opcode, wc.status.is_success()), (1, WcOpcode::RdmaWrite, true), "{wc:?}");
    assert_eq!(read_region(&target, 1000, 4096), pattern(4096, 9));
    assert_eq!(read_region(&target, 0, 1000), initial[..1000].to_vec(), "bytes before the write changed");
    let back = pair.a.alloc(100, AccessFlags::LOCAL_WRITE);
    let op = SendOp::Read { remote_addr: remote.addr, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::new(2, op, &[back.sge(0, 100)])).expect("post read");
    assert!(pair.a.wait_one().status.is_success());
    assert_eq!(read_region(&back, 0, 100), initial[..100].to_vec());
}

/// The completion queue's fd becomes readable for poll(2) (as for epoll or tokio's AsyncFd)
/// after `request_notify` once a completion arrives, and not before.
fn notify_fd_wakes_poll() {
    use lightpath_verbs::conformance::harness::Pair;
    use lightpath_verbs::{
        AccessFlags, CompletionQueue, MemoryRegion, QueuePair, SendOp, SendWr, WcOpcode, WcStatus,
        WorkCompletion,
    };
    let pair = Pair::connected::<OneDevice>();
    let cq = &pair.b.cq;
    let fd = cq.notify_fd().expect("an fd");
    let readable = |millis: i32| {
        let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pollfd, 1, millis) == 1 }
    };
    cq.request_notify().expect("arm");
    assert!(!readable(50), "readable before any completion");
    let inbox = pair.b.alloc(64, AccessFlags::LOCAL_WRITE);
    let src = pair.a.alloc(64, AccessFlags::LOCAL_WRITE);
    pair.b.post_recv(5, &inbox, 0, 64);
    pair.a.qp.post_send(&SendWr::new(6, SendOp::Send, &[src.sge(0, 8)])).expect("post_send");
    assert!(readable(30_000), "the fd did not become readable");
    assert!(cq.take_notify().expect("take_notify"));
    let mut wc = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)];
    assert_eq!(cq.poll(&mut wc).expect("poll"), 1);
    assert_eq!((wc[0].wr_id, wc[0].opcode), (5, WcOpcode::Recv));
    assert!(!readable(0), "still readable after the notification was taken");
}
