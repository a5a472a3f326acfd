//! The lines `ibv_rc_pingpong` prints, reproduced character for character so that scripts
//! written for the rdma-core tool read ours: the local and remote address lines and the two
//! summary lines.

use std::fmt::Write;
use std::time::Duration;

use lightpath_verbs::Gid;

use super::oob::PeerAddress;

/// `  local address:  LID 0x0000, QPN 0x000011, PSN 0x5a3c1f, GID ::ffff:10.0.0.1`
pub fn local_line(address: &PeerAddress) -> String {
    address_line("local address: ", address)
}

/// `  remote address: LID 0x0000, QPN 0x000012, PSN 0x1b2c3d, GID ::ffff:10.0.0.2`
pub fn remote_line(address: &PeerAddress) -> String {
    address_line("remote address:", address)
}

fn address_line(label: &str, address: &PeerAddress) -> String {
    format!(
        "  {label} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        address.lid,
        address.qpn,
        address.psn,
        inet_ntop6(address.gid)
    )
}

/// The GID as glibc's `inet_ntop(AF_INET6, …)` writes it, which is what the C tool prints: the
/// longest run of two or more zero groups (the first one on a tie) becomes `::`, groups are
/// lower-case hex without leading zeros, and an address whose first 96 bits are zero, or
/// zero then `ffff`, ends in dotted IPv4.
pub fn inet_ntop6(gid: Gid) -> String {
    let words: Vec<u16> = gid.0.chunks_exact(2).map(|pair| u16::from_be_bytes([pair[0], pair[1]])).collect();
    let mut best: Option<(usize, usize)> = None;
    let mut run: Option<(usize, usize)> = None;
    for (i, &word) in words.iter().enumerate() {
        if word == 0 {
            run = Some(run.map_or((i, 1), |(base, len)| (base, len + 1)));
        } else {
            run = None;
        }
        if let Some((base, len)) = run {
            if best.is_none_or(|(_, best_len)| len > best_len) {
                best = Some((base, len));
            }
        }
    }
    let best = best.filter(|&(_, len)| len >= 2);
    let mut out = String::new();
    for (i, &word) in words.iter().enumerate() {
        if let Some((base, len)) = best {
            if (base..base + len).contains(&i) {
                if i == base {
                    out.push(':');
                }
                continue;
            }
        }
        if i != 0 {
            out.push(':');
        }
        let embeds_ipv4 = matches!(best, Some((0, 6))) || (best == Some((0, 5)) && words[5] == 0xffff);
        if i == 6 && embeds_ipv4 {
            let b = &gid.0[12..];
            let _ = write!(out, "{}.{}.{}.{}", b[0], b[1], b[2], b[3]);
            return out;
        }
        let _ = write!(out, "{word:x}");
    }
    if best.is_some_and(|(base, len)| base + len == 8) {
        out.push(':');
    }
    out
}

/// The two summary lines. As in the C tool, the time is counted in whole microseconds held in
/// a C `float`, the bytes are `size × iters × 2` (both directions), and the rates follow from
/// those.
pub fn summary_lines(size: u32, iters: u32, elapsed: Duration) -> [String; 2] {
    // At least 1 µs: the C tool would print inf for a zero, which no real run reaches.
    let usec = elapsed.as_micros().max(1) as f32;
    let bytes = u64::from(size) * u64::from(iters) * 2;
    let seconds = f64::from(usec) / 1_000_000.0;
    [
        format!(
            "{bytes} bytes in {seconds:.2} seconds = {:.2} Mbit/sec",
            bytes as f64 * 8.0 / f64::from(usec)
        ),
        format!("{iters} iters in {seconds:.2} seconds = {:.2} usec/iter", f64::from(usec / iters as f32)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ntop(text: &str) -> String {
        inet_ntop6(Gid(text.parse::<std::net::Ipv6Addr>().unwrap().octets()))
    }

    #[test]
    fn gids_print_as_glibc_prints_them() {
        assert_eq!(ntop("::ffff:10.78.0.2"), "::ffff:10.78.0.2");
        assert_eq!(ntop("::"), "::");
        assert_eq!(ntop("::1"), "::1");
        // IPv4-compatible addresses: glibc prints them dotted (Rust's Display does not).
        assert_eq!(ntop("::10.1.2.3"), "::10.1.2.3");
        assert_eq!(ntop("fe80::1:2"), "fe80::1:2");
        assert_eq!(ntop("2001:db8::"), "2001:db8::");
        // A single zero group is not shortened; the first of two equal runs is.
        assert_eq!(ntop("1:0:2:3:4:5:6:7"), "1:0:2:3:4:5:6:7");
        assert_eq!(ntop("1:0:0:2:0:0:3:4"), "1::2:0:0:3:4");
        assert_eq!(ntop("1:0:0:2:0:0:0:4"), "1:0:0:2::4");
        assert_eq!(ntop("fe80::abcd:ef01:2345:6789"), "fe80::abcd:ef01:2345:6789");
    }

    #[test]
    fn address_lines() {
        let address = PeerAddress { lid: 0, qpn: 0x11, psn: 0x5a3c1f, gid: "10.78.0.2".parse().unwrap() };
        assert_eq!(
            local_line(&address),
            "  local address:  LID 0x0000, QPN 0x000011, PSN 0x5a3c1f, GID ::ffff:10.78.0.2"
        );
        assert_eq!(
            remote_line(&address),
            "  remote address: LID 0x0000, QPN 0x000011, PSN 0x5a3c1f, GID ::ffff:10.78.0.2"
        );
    }

    #[test]
    fn summary() {
        let [bytes, iters] = summary_lines(4096, 1000, Duration::from_micros(52_345));
        assert_eq!(bytes, "8192000 bytes in 0.05 seconds = 1252.00 Mbit/sec");
        assert_eq!(iters, "1000 iters in 0.05 seconds = 52.35 usec/iter");
        let [bytes, iters] = summary_lines(1, 3, Duration::from_secs(2));
        assert_eq!(bytes, "6 bytes in 2.00 seconds = 0.00 Mbit/sec");
        assert_eq!(iters, "3 iters in 2.00 seconds = 666666.69 usec/iter");
    }
}
