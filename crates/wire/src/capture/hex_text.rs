//! Packets written as hex text.
//!
//! Two layouts are understood, and may be mixed:
//! * **offset dumps**, lines like `0010  00 30 03 1f 40 00 ...` (an offset of 4 to 8 hex digits,
//!   then two-digit bytes; an xxd-style ASCII column is ignored). Offset 0 starts a new packet.
//! * **plain hex**: whitespace, `:`, `,` and `0x` prefixes are ignored.
//!
//! `#` starts a comment; a blank or comment line ends a packet. A plain-hex packet identical to
//! the offset dump just before it is dropped: the capture vectors hold each packet in both
//! forms.

use core::fmt;

/// Why a text could not be read as hex packets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HexTextError {
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub reason: String,
}

impl fmt::Display for HexTextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for HexTextError {}

/// Splits a text into packets (see the module documentation for the layouts).
pub fn parse_packets(text: &str) -> Result<Vec<Vec<u8>>, HexTextError> {
    let mut packets: Vec<(Vec<u8>, Form)> = Vec::new();
    let mut current: Option<Pending> = None;
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        let code = raw.find('#').map_or(raw, |at| &raw[..at]);
        if let Some((offset, bytes)) = offset_line(code) {
            match &mut current {
                Some(Pending::Offset(packet)) if offset != 0 => packet.extend_from_slice(&bytes),
                _ => {
                    finish(&mut packets, current.take())?;
                    current = Some(Pending::Offset(bytes));
                }
            }
        } else if code.trim().is_empty() {
            finish(&mut packets, current.take())?;
        } else {
            if !matches!(current, Some(Pending::Plain { .. })) {
                finish(&mut packets, current.take())?;
                current = Some(Pending::Plain { digits: String::new(), line: number });
            }
            if let Some(Pending::Plain { digits, .. }) = &mut current {
                push_plain_digits(digits, code, number)?;
            }
        }
    }
    finish(&mut packets, current.take())?;
    Ok(packets.into_iter().map(|(bytes, _)| bytes).collect())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Offset,
    Plain,
}

enum Pending {
    Offset(Vec<u8>),
    Plain { digits: String, line: usize },
}

/// `(offset, bytes)` if the line is an offset-dump line.
fn offset_line(line: &str) -> Option<(usize, Vec<u8>)> {
    let mut tokens = line.split_whitespace();
    let offset = tokens.next()?;
    let offset = offset.strip_suffix(':').unwrap_or(offset);
    if !(4..=8).contains(&offset.len()) || !offset.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut bytes = Vec::new();
    for token in tokens {
        // xxd-style dumps end in an ASCII column: stop at the first token that is not a byte.
        match (token.len(), u8::from_str_radix(token, 16)) {
            (2, Ok(byte)) => bytes.push(byte),
            _ => break,
        }
    }
    if bytes.is_empty() {
        return None;
    }
    Some((usize::from_str_radix(offset, 16).ok()?, bytes))
}

fn push_plain_digits(digits: &mut String, code: &str, line: usize) -> Result<(), HexTextError> {
    for word in code.split(|c: char| c.is_whitespace() || c == ':' || c == ',') {
        let word = word.strip_prefix("0x").or_else(|| word.strip_prefix("0X")).unwrap_or(word);
        if let Some(bad) = word.chars().find(|c| !c.is_ascii_hexdigit()) {
            return Err(HexTextError { line, reason: format!("not a hex digit: {bad:?}") });
        }
        digits.push_str(word);
    }
    Ok(())
}

fn finish(packets: &mut Vec<(Vec<u8>, Form)>, pending: Option<Pending>) -> Result<(), HexTextError> {
    let (bytes, form) = match pending {
        None => return Ok(()),
        Some(Pending::Offset(bytes)) => (bytes, Form::Offset),
        Some(Pending::Plain { digits, line }) => {
            if !digits.len().is_multiple_of(2) {
                return Err(HexTextError {
                    line,
                    reason: format!("odd number of hex digits ({}) in a packet", digits.len()),
                });
            }
            let bytes = (0..digits.len() / 2)
                .map(|i| u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).unwrap_or(0))
                .collect();
            (bytes, Form::Plain)
        }
    };
    if bytes.is_empty() {
        return Ok(());
    }
    if form == Form::Plain && packets.last() == Some(&(bytes.clone(), Form::Offset)) {
        return Ok(());
    }
    packets.push((bytes, form));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_hex_with_separators() {
        let packets = parse_packets("0x45 00:00 1c\n  aB cd # trailing comment\n").unwrap();
        assert_eq!(packets, vec![vec![0x45, 0x00, 0x00, 0x1c, 0xab, 0xcd]]);
        let packets = parse_packets("0102\n\n# next\n0304\n0506").unwrap();
        assert_eq!(packets, vec![vec![1, 2], vec![3, 4, 5, 6]]);
    }

    #[test]
    fn plain_hex_errors_name_the_line() {
        let err = parse_packets("0102\n03zz\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(err.reason.contains("'z'"));
        assert_eq!(parse_packets("010\n").unwrap_err().line, 1);
    }

    #[test]
    fn offset_dumps_and_their_one_line_copies() {
        let text = "# a comment\n0000  45 00 00 30\n0004  03 1f\n# one-line:\n4500003003 1f\n\
                    0000  01 02\n0002  03\n# different one-line:\n0a0b\n";
        assert_eq!(
            parse_packets(text).unwrap(),
            vec![vec![0x45, 0, 0, 0x30, 3, 0x1f], vec![1, 2, 3], vec![0x0a, 0x0b]]
        );
    }

    #[test]
    fn xxd_ascii_column_is_ignored() {
        let text = "00000000: 45 00 00 30  E..0\n";
        assert_eq!(parse_packets(text).unwrap(), vec![vec![0x45, 0, 0, 0x30]]);
    }

    #[test]
    fn grouped_hex_is_plain() {
        assert_eq!(
            parse_packets("45000030 031f4000").unwrap(),
            vec![vec![0x45, 0, 0, 0x30, 3, 0x1f, 0x40, 0]]
        );
    }
}
