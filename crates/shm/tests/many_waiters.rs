//! Many threads blocked in `CompletionQueue::wait` on one shm device, as a server
//! with a thread per connection has them: only one of them watches the doorbell, the others
//! sleep on their own queue's wake-up, and every one still gets each of its completions.

use std::time::Duration;

use lightpath_shm::{ShmConfig, ShmDevice};
use lightpath_verbs::conformance::harness::{PairOptions, Side, MR_ALL};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, MemoryRegion, Mtu, QpAttr, QueuePair, RecvWr, SendOp,
    SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const PAIRS: usize = 24;
const ROUNDS: u64 = 100;

fn open() -> ShmDevice {
    ShmDevice::open(ShmConfig::default()).expect("open an shm device")
}

fn connect(side: &Side<ShmDevice>, peer: &Side<ShmDevice>) {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    side.qp.modify(&QpAttr::to_init(access)).expect("INIT");
    let endpoint = peer.qp.endpoint();
    let av = AddressVector::new(endpoint.gid, 0);
    side.qp.modify(&QpAttr::to_rtr(av, Mtu::Mtu1024, endpoint.qpn, 1)).expect("RTR");
    side.qp.modify(&QpAttr::to_rts(1)).expect("RTS");
}

/// Blocks for the next completion; a waiter that is never woken fails here, not by hanging.
fn next(cq: &impl CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)];
    let n = cq.wait(&mut wc, Duration::from_secs(10)).expect("wait");
    assert_eq!(n, 1, "no completion within 10 s: a waiter was never woken");
    assert!(wc[0].status.is_success(), "{:?}", wc[0]);
    wc[0]
}

#[test]
fn every_blocked_waiter_gets_its_completions() {
    let (a, b) = (open(), open());
    let pairs: Vec<(Side<ShmDevice>, Side<ShmDevice>)> = (0..PAIRS)
        .map(|_| {
            let (x, y) = (
                Side::new(a.clone(), &PairOptions::default()),
                Side::new(b.clone(), &PairOptions::default()),
            );
            connect(&x, &y);
            connect(&y, &x);
            (x, y)
        })
        .collect();
    std::thread::scope(|scope| {
        for (i, (client, server)) in pairs.iter().enumerate() {
            // Server: receive a word, send it back plus one; every wait blocks.
            scope.spawn(move || {
                let mr = server.alloc(64, MR_ALL);
                for _ in 0..ROUNDS {
                    server.qp.post_recv(&RecvWr::new(1, &[mr.sge(0, 8)])).unwrap();
                    assert_eq!(next(&server.cq).opcode, WcOpcode::Recv);
                    let value = mr.read_u64(0).unwrap();
                    mr.write_u64(8, value + 1).unwrap();
                    server.qp.post_send(&SendWr::new(2, SendOp::Send, &[mr.sge(8, 8)])).unwrap();
                    assert_eq!(next(&server.cq).opcode, WcOpcode::Send);
                }
            });
            // Client: ping-pong, checking each answer.
            scope.spawn(move || {
                let mr = client.alloc(64, MR_ALL);
                for round in 0..ROUNDS {
                    let value = (i as u64) << 32 | round;
                    client.qp.post_recv(&RecvWr::new(3, &[mr.sge(8, 8)])).unwrap();
                    mr.write_u64(0, value).unwrap();
                    client.qp.post_send(&SendWr::new(4, SendOp::Send, &[mr.sge(0, 8)])).unwrap();
                    let seen = [next(&client.cq).opcode, next(&client.cq).opcode];
                    assert!(seen.contains(&WcOpcode::Recv) && seen.contains(&WcOpcode::Send), "{seen:?}");
                    assert_eq!(mr.read_u64(8).unwrap(), value + 1, "pair {i} round {round}");
                }
            });
        }
    });
}
