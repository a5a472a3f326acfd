//! Connect/close cycles leave nothing behind (issue 15): after hundreds of connections, each
//! opened, used and closed in turn, the process holds no more descriptors than after the
//! first ones, over shm and over soft. (`examples/cycles.rs` runs 100,000 and reports memory
//! too; this is its short form for every test run.)

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lightpath::{Listener, Options, Stream};

mod common;

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Descriptors once closes have settled (a dropped stream finishes its clean close on a
/// background thread): the count after it stopped falling for 300 ms, at most 10 s.
fn settled_fds() -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = open_fds();
    let mut steady_since = Instant::now();
    while Instant::now() < deadline && steady_since.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(50));
        let now = open_fds();
        if now < last {
            steady_since = Instant::now();
        }
        last = now;
    }
    last
}

/// Runs `cycles` connect / echo / close cycles against a listener of this process.
fn cycle(listener: &Listener, options: &Options, cycles: usize) {
    let addr = listener.local_addr().expect("address");
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..cycles {
                let (mut stream, _) = listener.accept().expect("accept");
                let mut buf = [0u8; 64];
                stream.read_exact(&mut buf).expect("server read");
                stream.write_all(&buf).expect("server write");
                let mut rest = [0u8; 1];
                assert_eq!(
                    stream.read(&mut rest).expect("server read at close"),
                    0,
                    "bytes after the message"
                );
            }
        });
        for i in 0..cycles {
            let mut stream = Stream::connect_with(addr, options).expect("connect");
            assert!(stream.transport().is_rdma(), "cycle {i}: {:?}", stream.transport());
            let message = [i as u8; 64];
            stream.write_all(&message).expect("client write");
            let mut back = [0u8; 64];
            stream.read_exact(&mut back).expect("client read");
            assert_eq!(back, message, "cycle {i}");
        }
    });
}

/// The count is the whole process's: the two tests take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn no_descriptor_grows(options: Options) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let listener = common::listener(options.clone());
    // The first connections open the device, its threads and its pools.
    cycle(&listener, &options, 30);
    let before = settled_fds();
    cycle(&listener, &options, 300);
    let after = settled_fds();
    assert!(after <= before, "descriptors grew from {before} to {after} over 300 connect/close cycles");
}

#[test]
fn shm_connect_close_cycles_leave_no_descriptor_behind() {
    no_descriptor_grows(common::shm());
}

#[test]
fn soft_connect_close_cycles_leave_no_descriptor_behind() {
    no_descriptor_grows(common::soft());
}
