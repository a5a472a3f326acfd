//! Runs the built `lightpath decode` on the captured RoCE v2 vectors (Linux rxe between two VMs,
//! and the protocol digest's worked examples), on corrupted and foreign packets, and on pcap
//! files built from the vectors.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use lightpath_wire::capture::pcap;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".txt"))
        .collect();
    names.sort();
    names
}

fn fixture_text(name: &str) -> String {
    std::fs::read_to_string(fixtures().join(name)).unwrap()
}

/// The packet bytes of a fixture (its last line is the packet as one hex string).
fn fixture_bytes(name: &str) -> Vec<u8> {
    let text = fixture_text(name);
    let line = text.lines().last().unwrap();
    (0..line.len() / 2).map(|i| u8::from_str_radix(&line[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lightpath"))
        .arg("decode")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

#[test]
fn every_fixture_decodes_with_a_good_icrc() {
    let names = fixture_names();
    assert_eq!(names.len(), 8);
    for name in names {
        let output = decode(&[], &fixture_text(&name));
        let text = stdout(&output);
        assert_eq!(output.status.code(), Some(0), "{name}:\n{text}");
        assert!(text.contains("icrc            ok (0x"), "{name}:\n{text}");
        assert!(text.contains("1 packet: 1 good, 0 bad ICRC, 0 failed to decode"), "{name}:\n{text}");
        for layer in ["ipv4 ", "udp ", "bth ", "payload "] {
            assert!(text.lines().any(|l| l.starts_with(layer)), "{name}: no {layer}:\n{text}");
        }
    }
}

#[test]
fn fields_and_opcode_names_are_printed() {
    let text = stdout(&decode(&[], &fixture_text("two-vm-rc-rdma-read-request.txt")));
    assert!(text.contains("opcode_name=RC_RDMA_READ_REQUEST"), "{text}");
    assert!(text.contains("reth            va=0x00005587eca4f000 rkey=0x000005cd dma_len=64"), "{text}");
    assert!(text.contains("psn=0xae4bf0"), "{text}");
    let text = stdout(&decode(&[], &fixture_text("two-vm-rc-ack.txt")));
    assert!(text.contains("syndrome=0x1f meaning=\"ACK, no credit limit (code 31)\" msn=1"), "{text}");
    let text = stdout(&decode(&[], &fixture_text("digest-connectx-cnp.txt")));
    assert!(text.contains("opcode_name=CNP") && text.contains("becn=1"), "{text}");
}

#[test]
fn all_fixtures_as_arguments_and_one_stream() {
    let mut all = String::new();
    for name in fixture_names() {
        let hex = to_hex(&fixture_bytes(&name));
        let output = decode(&[&hex], "");
        assert_eq!(output.status.code(), Some(0), "{name}: {}", stdout(&output));
        all.push_str(&fixture_text(&name));
    }
    let output = decode(&[], &all);
    assert_eq!(output.status.code(), Some(0));
    assert!(stdout(&output).contains("8 packets: 8 good, 0 bad ICRC, 0 failed to decode"));
}

#[test]
fn separators_in_hex_are_tolerated() {
    let bytes = fixture_bytes("digest-rc-ack.txt");
    let spaced: Vec<String> = bytes.iter().map(|b| format!("0x{b:02X}")).collect();
    let output = decode(&[], &spaced.join(" "));
    assert_eq!(output.status.code(), Some(0), "{}", stdout(&output));
    let colons: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let output = decode(&["--from", "ip", &colons.join(":")], "");
    assert_eq!(output.status.code(), Some(0), "{}", stdout(&output));
}

#[test]
fn a_corrupted_packet_reports_bad_icrc_and_exits_1() {
    let mut bytes = fixture_bytes("two-vm-rc-send-only.txt");
    bytes[60] ^= 0x40; // a payload byte
    let output = decode(&[&to_hex(&bytes)], "");
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("icrc            BAD (computed 0x"), "{text}");
    assert!(text.contains("found 0xf776e3c4)"), "{text}");
    // Mixed with good packets the exit status is still 1.
    let mut mixed = fixture_text("two-vm-rc-ack.txt");
    mixed.push_str(&format!("# corrupted\n{}\n", to_hex(&bytes)));
    let output = decode(&[], &mixed);
    assert_eq!(output.status.code(), Some(1));
    assert!(stdout(&output).contains("2 packets: 1 good, 1 bad ICRC"), "{}", stdout(&output));
}

#[test]
fn json_has_one_object_per_packet() {
    let mut all = fixture_text("two-vm-rc-rdma-write-first.txt");
    all.push_str(&fixture_text("digest-rc-ack.txt"));
    let output = decode(&["--json"], &all);
    assert_eq!(output.status.code(), Some(0));
    let objects: Vec<serde_json::Value> =
        stdout(&output).lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(objects.len(), 2);
    assert_eq!(objects[0]["layers"]["bth"]["opcode_name"], "RC_RDMA_WRITE_FIRST");
    assert_eq!(objects[0]["layers"]["reth"]["dma_len"], 2500);
    assert_eq!(objects[0]["layers"]["payload"]["len"], 1024);
    assert_eq!(objects[0]["layers"]["ethernet"]["ethertype"], "0x0800");
    assert_eq!(objects[0]["icrc"]["status"], "ok");
    assert_eq!(objects[1]["layers"]["aeth"]["msn"], 1);
    assert_eq!(objects[1]["icrc"]["found"], "0x8768a9ab");
    assert_eq!(objects[1]["ok"], true);
    assert!(objects[1]["layers"].get("ethernet").is_none());
}

#[test]
fn non_roce_and_broken_input_never_panic() {
    let mut dns = fixture_bytes("digest-rc-ack.txt");
    dns[22..24].copy_from_slice(&[0, 53]);
    let output = decode(&[&to_hex(&dns)], "");
    assert_eq!(output.status.code(), Some(1));
    assert!(stdout(&output).contains("UDP destination port 53 is not 4791"), "{}", stdout(&output));
    let frame = fixture_bytes("two-vm-rc-ack.txt");
    for len in [1, 13, 20, 33, 41, 50, frame.len() - 1] {
        let output = decode(&[&to_hex(&frame[..len])], "");
        assert_eq!(output.status.code(), Some(1), "len {len}: {}", stdout(&output));
        assert!(String::from_utf8_lossy(&output.stderr).is_empty(), "len {len}");
    }
    let output = decode(&["--from", "ip", &to_hex(&frame)], "");
    assert_eq!(output.status.code(), Some(1));
    let output = decode(&["zz"], "");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a hex digit"));
}

#[test]
fn bare_udp_payloads_are_checked_when_addresses_are_given() {
    let frame = fixture_bytes("two-vm-rc-send-only.txt");
    let payload = to_hex(&frame[42..]);
    let output = decode(&["--from", "udp-payload", &payload], "");
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("not checked"), "{text}");
    let with_addresses =
        ["--from", "udp-payload", "--src", "10.77.0.3", "--dst", "10.77.0.2", "--sport", "49441"];
    let output = decode(&[&with_addresses[..], &[payload.as_str()]].concat(), "");
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("ID 0xbc0d"), "{text}");
    let output = decode(&[&with_addresses[..6], &["--sport", "1", payload.as_str()]].concat(), "");
    assert_eq!(output.status.code(), Some(1));
}

fn write_pcap(name: &str, frames: &[Vec<u8>]) -> PathBuf {
    let mut file = Vec::new();
    pcap::write_header(&mut file, pcap::LINKTYPE_ETHERNET);
    for (i, frame) in frames.iter().enumerate() {
        pcap::write_record(&mut file, 1_700_000_000_000_000_000 + i as u64 * 1000, frame);
    }
    let path = std::env::temp_dir().join(format!("lightpath-decode-{}-{name}", std::process::id()));
    std::fs::write(&path, file).unwrap();
    path
}

#[test]
fn pcap_files_are_read() {
    let mut frames: Vec<Vec<u8>> =
        fixture_names().iter().filter(|n| n.starts_with("two-vm")).map(|n| fixture_bytes(n)).collect();
    let mut arp = frames[0][..42].to_vec();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    frames.push(arp);
    let path = write_pcap("good.pcap", &frames);
    let output = decode(&["--pcap", path.to_str().unwrap()], "");
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("6 packets: 5 good, 0 bad ICRC, 0 failed to decode, 1 not RoCE v2"), "{text}");
    assert!(text.contains("pcap record 6"), "{text}");

    frames[1][50] ^= 1;
    let bad = write_pcap("bad.pcap", &frames);
    let output = decode(&["--pcap", bad.to_str().unwrap(), "--json"], "");
    assert_eq!(output.status.code(), Some(1));
    let statuses: Vec<String> = stdout(&output)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["icrc"]["status"].to_string())
        .collect();
    assert_eq!(statuses.iter().filter(|s| s.as_str() == "\"bad\"").count(), 1);

    let pcapng = std::env::temp_dir().join(format!("lightpath-decode-{}.pcapng", std::process::id()));
    std::fs::write(&pcapng, [0x0A, 0x0D, 0x0D, 0x0A, 0x1C, 0, 0, 0]).unwrap();
    let output = decode(&["--pcap", pcapng.to_str().unwrap()], "");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("pcapng"));
    for file in [path, bad, pcapng] {
        std::fs::remove_file(file).unwrap();
    }
}
