//! Case: what a device reports about itself.

use crate::conformance::harness::{assert_refused, PairOptions, Side};
use crate::conformance::ConformanceFixture;
use crate::{Device, Error, PortState, ProtectionDomain, QpState, QueuePair};

/// Limits, port 1, the GID table, and the endpoint a fresh queue pair reports.
pub fn device_query<F: ConformanceFixture>() {
    let (a, b) = F::open_pair();
    for device in [a, b] {
        assert!(!device.name().is_empty(), "device name is empty");
        let attr = device.query().expect("query");
        assert!(attr.phys_port_cnt >= 1, "{attr:?}");
        assert!(attr.max_qp >= 2 && attr.max_cq >= 1 && attr.max_mr >= 1 && attr.max_pd >= 1, "{attr:?}");
        assert!(attr.max_qp_wr >= 1 && attr.max_sge >= 1 && attr.max_cqe >= 1, "{attr:?}");
        assert!(attr.max_mr_size >= 1 << 20, "regions of 1 MiB must be possible: {attr:?}");

        let port = device.query_port(1).expect("query_port(1)");
        assert_eq!(port.state, PortState::Active, "{port:?}");
        assert!(port.active_mtu <= port.max_mtu, "{port:?}");
        assert!(port.gid_tbl_len >= 1, "{port:?}");
        assert_refused(device.query_port(0), "port 0", |e| {
            matches!(e, Error::InvalidAttribute(_) | Error::NotFound(_))
        });
        let past_last = attr.phys_port_cnt.saturating_add(1);
        assert_refused(device.query_port(past_last), "port past the last", |e| {
            matches!(e, Error::InvalidAttribute(_) | Error::NotFound(_))
        });

        let gids = device.gids(1).expect("gids(1)");
        assert!(!gids.is_empty() && gids.len() as u32 <= port.gid_tbl_len, "{gids:?} vs {port:?}");

        let side = Side::new(device, &PairOptions::default());
        let other_qp = side.pd.create_qp(&side.cq, &side.cq, PairOptions::default().caps).expect("second QP");
        let endpoint = side.qp.endpoint();
        assert_eq!(endpoint.qpn, side.qp.qpn());
        assert!(endpoint.qpn >= 2 && endpoint.qpn < 1 << 24, "QPN {} (0 and 1 are reserved)", endpoint.qpn);
        assert_ne!(other_qp.qpn(), side.qp.qpn(), "two queue pairs share a number");
        assert!(!endpoint.gid.is_zero(), "endpoint GID is zero");
        assert_eq!(
            gids.get(usize::from(endpoint.gid_index)),
            Some(&endpoint.gid),
            "endpoint GID not in table"
        );
        assert_eq!(side.qp.state().expect("state"), QpState::Reset);
    }
}
