//! `lightpath plot` as a process: JSON lines of two providers in, an SVG with both series out;
//! bad input gets a clear error and no file.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_lightpath");

fn line(provider: &str, size: u64, bw: f64) -> String {
    format!(
        r#"{{"test":"write_bw","provider":"{provider}","size":{size},"iters":5,"bw_mb_s":{bw},"verified":true}}"#
    )
}

#[test]
fn plot_draws_one_series_per_provider() {
    let dir = std::env::temp_dir().join(format!("lightpath-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let soft: Vec<String> = (1..=23).map(|s| line("soft", 1 << s, 10.0 * s as f64)).collect();
    let tcp: Vec<String> = (1..=23).map(|s| line("tcp", 1 << s, 20.0 * s as f64)).collect();
    std::fs::write(dir.join("soft.jsonl"), soft.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("tcp.jsonl"), tcp.join("\n")).unwrap();
    let out = dir.join("bw.svg");
    let run = Command::new(BIN)
        .arg("plot")
        .args([dir.join("soft.jsonl"), dir.join("tcp.jsonl")])
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    let texts: Vec<&str> = svg.lines().filter(|l| !l.starts_with('<')).collect();
    for text in ["soft", "tcp", "bandwidth [MB/s]", "4 MiB"] {
        assert!(texts.contains(&text), "no {text:?} in {texts:?}");
    }
    assert_eq!(svg.matches("<circle").count(), 46);

    // A table instead of JSON lines: refused, with the file and line named.
    std::fs::write(dir.join("table.txt"), "# write_bw over soft\n").unwrap();
    let bad = Command::new(BIN)
        .arg("plot")
        .arg(dir.join("table.txt"))
        .arg("-o")
        .arg(dir.join("bad.svg"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("table.txt:1: not a `lightpath perf --json` result line"), "{err}");
    assert!(!dir.join("bad.svg").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
