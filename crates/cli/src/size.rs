//! Byte counts on the command line. Every `lightpath perf` test reads its sizes the same way:
//! a plain number of bytes (`65536`), or one with a binary suffix (`64K`, `64KiB`, `1M`,
//! `16MiB`, `1G`; case does not matter), as OSU's and nccl-tests' sizes are written. Before,
//! the collective tests took suffixes and the verbs and stream tests refused them.

/// Parses a byte count: digits, then optionally `K`/`KiB` (2^10), `M`/`MiB` (2^20) or
/// `G`/`GiB` (2^30). Refuses anything else, and counts that overflow a `u64`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is not a byte count (e.g. 8, 4096, 64K, 1M, 16MiB)");
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits);
    if number.is_empty() {
        return Err(bad());
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return Err(bad()),
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} is too large"))
}

/// [`parse_bytes`] for a `usize` option.
pub fn parse_usize(text: &str) -> Result<usize, String> {
    usize::try_from(parse_bytes(text)?).map_err(|_| format!("{text:?} is too large"))
}

/// [`parse_bytes`] for a `u32` option (at most 4 GiB - 1).
pub fn parse_u32(text: &str) -> Result<u32, String> {
    u32::try_from(parse_bytes(text)?).map_err(|_| format!("{text:?} is too large (at most 4294967295 bytes)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_numbers_and_binary_suffixes() {
        assert_eq!(parse_bytes("65536"), Ok(65536));
        assert_eq!(parse_bytes(" 8 "), Ok(8));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("64k"), Ok(64 << 10));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes("16mib"), Ok(16 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("0"), Ok(0), "range checks belong to the option");
    }

    #[test]
    fn anything_else_is_refused_with_the_text() {
        for text in ["", "K", "1.5M", "-1", "64KB", "1T", "12 M", "0x10", "M1"] {
            let err = parse_bytes(text).expect_err(text);
            assert!(err.contains(&format!("{text:?}")), "{err}");
        }
        assert!(parse_bytes("99999999999999999999").is_err(), "more digits than a u64 holds");
        assert!(parse_bytes("18014398509481984G").unwrap_err().contains("too large"));
    }

    #[test]
    fn narrower_types_refuse_what_does_not_fit() {
        assert_eq!(parse_u32("1M"), Ok(1 << 20));
        assert_eq!(parse_u32("3G"), Ok(3 << 30));
        assert!(parse_u32("4G").unwrap_err().contains("too large"));
        assert_eq!(parse_usize("64M"), Ok(64 << 20));
    }
}
