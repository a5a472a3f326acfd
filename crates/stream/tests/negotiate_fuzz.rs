//! Property tests of the negotiation parser: arbitrary bytes never panic it, whatever it
//! accepts re-encodes to something that parses the same, and every message survives
//! emit → parse.

use lightpath_stream::negotiate::{Choice, FallbackReason, Message, ProviderId, RdmaEndpoint};
use proptest::prelude::*;

fn endpoint() -> impl Strategy<Value = RdmaEndpoint> {
    (
        any::<[u8; 16]>(),
        any::<u16>(),
        0u32..1 << 24,
        0u32..1 << 24,
        prop::sample::select(vec![256u16, 512, 1024, 2048, 4096]),
        any::<u64>(),
        64u32..,
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        8u16..,
    )
        .prop_map(
            |(
                gid,
                udp_port,
                qpn,
                psn,
                mtu,
                ring_addr,
                ring_len,
                ring_rkey,
                credit_addr,
                credit_rkey,
                recv_depth,
            )| {
                RdmaEndpoint {
                    gid,
                    udp_port,
                    qpn,
                    psn,
                    mtu,
                    ring_addr,
                    ring_len,
                    ring_rkey,
                    credit_addr,
                    credit_rkey,
                    recv_depth,
                }
            },
        )
}

fn provider() -> impl Strategy<Value = ProviderId> {
    prop::sample::select(vec![ProviderId::Soft, ProviderId::Ibverbs, ProviderId::Shm])
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u8>(), any::<u8>(), prop::collection::vec(provider(), 0..8), any::<[u8; 16]>()).prop_map(
            |(a, b, providers, host_id)| Message::ClientHello {
                min_version: a.min(b),
                max_version: a.max(b),
                providers,
                host_id
            }
        ),
        (any::<u8>(), provider(), endpoint())
            .prop_map(|(version, p, e)| Message::ServerHello { version, choice: Choice::Rdma(p, e) }),
        (any::<u8>(), 1u8..).prop_map(|(version, code)| Message::ServerHello {
            version,
            choice: Choice::Tcp(FallbackReason::from_code(code))
        }),
        endpoint().prop_map(Message::Connect),
        Just(Message::Ready),
        Just(Message::Confirm),
        (any::<u8>(), "[a-z ]{0,40}")
            .prop_map(|(code, detail)| Message::Fallback { reason: FallbackReason::from_code(code), detail }),
        (any::<u64>(), any::<u64>()).prop_map(|(bytes, records)| Message::Bye { bytes, records }),
        "\\PC{0,60}".prop_map(Message::Error),
    ]
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(Some((message, used))) = Message::parse(&bytes) {
            prop_assert!(used <= bytes.len());
            let again = message.to_bytes();
            prop_assert_eq!(Message::parse(&again), Ok(Some((message, again.len()))));
        }
    }

    #[test]
    fn messages_round_trip(message in message()) {
        let bytes = message.to_bytes();
        prop_assert_eq!(Message::parse(&bytes), Ok(Some((message.clone(), bytes.len()))));
        // A prefix is never mistaken for a whole message.
        for cut in 0..bytes.len() {
            prop_assert_eq!(Message::parse(&bytes[..cut]), Ok(None));
        }
    }

    #[test]
    fn mutated_messages_parse_or_fail_cleanly(message in message(), at in any::<prop::sample::Index>(), flip in 1u8..) {
        let mut bytes = message.to_bytes();
        let at = at.index(bytes.len());
        bytes[at] ^= flip;
        let _ = Message::parse(&bytes);
    }
}
