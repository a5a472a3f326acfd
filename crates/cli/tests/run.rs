//! `lightpath run`: the preload library beside the binary is put in LD_PRELOAD, the provider
//! list and the report file reach the program, and two programs run under it talk over shm.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn lightpath() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_lightpath"))
}

/// The preload library beside the binary; built first (integration tests do not make cargo
/// build the cdylib of another package).
fn library_beside() -> Option<PathBuf> {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let dir = lightpath().parent()?.to_path_buf();
    BUILT.call_once(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-q", "-p", "lightpath-preload"]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let _ = build.status();
    });
    let lib = dir.join("liblightpath_preload.so");
    if lib.is_file() {
        Some(lib)
    } else {
        eprintln!("SKIPPED: {} is not built (cargo build -p lightpath-preload)", lib.display());
        None
    }
}

#[test]
fn run_sets_ld_preload_providers_and_report_for_the_program() {
    let Some(lib) = library_beside() else { return };
    let output = Command::new(lightpath())
        .args(["run", "--providers", "shm", "--report", "/tmp/x-report", "--peers", "10.1.0.0/16,fd00::1"])
        .args(["--", "sh", "-c"])
        .arg("echo \"$LD_PRELOAD|$LIGHTPATH_PROVIDERS|$LIGHTPATH_PRELOAD_REPORT|$LIGHTPATH_PRELOAD_PEERS\"")
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    let lib = lib.canonicalize().unwrap();
    assert_eq!(text.trim(), format!("{}|shm|/tmp/x-report|10.1.0.0/16,fd00::1", lib.display()));
}

#[test]
fn run_rejects_a_peer_rule_it_cannot_read() {
    for rule in ["10.1.0.0/33", "not-an-address", "fd00::/129"] {
        let output = Command::new(lightpath()).args(["run", "--peers", rule, "--", "true"]).output().unwrap();
        assert!(!output.status.success(), "{rule}: {output:?}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("--peers"), "{rule}: {output:?}");
    }
}

#[test]
fn run_rejects_an_unknown_provider_and_a_missing_program() {
    let output = Command::new(lightpath())
        .args(["run", "--providers", "carrier-pigeon", "--", "true"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown provider"), "{output:?}");
    if library_beside().is_some() {
        let output = Command::new(lightpath()).args(["run", "--", "/nonexistent/program"]).output().unwrap();
        assert!(!output.status.success());
        assert!(String::from_utf8_lossy(&output.stderr).contains("could not run"), "{output:?}");
    }
}

#[test]
fn two_programs_under_run_talk_over_shm() {
    if library_beside().is_none() {
        return;
    }
    if Command::new("python3").arg("-c").arg("1").output().is_err() {
        eprintln!("SKIPPED: python3 is not installed");
        return;
    }
    let dir = std::env::temp_dir().join(format!("lightpath-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("report");
    let _ = std::fs::remove_file(&report);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server_code = format!(
        "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
         s.bind(('127.0.0.1',{port}));s.listen(1);print('ready',flush=True)\nc,_=s.accept()\n\
         while True:\n d=c.recv(65536)\n if not d: break\n c.sendall(d)\nc.close()\n"
    );
    let mut server = Command::new(lightpath())
        .args(["run", "--report"])
        .arg(&report)
        .args(["--", "python3", "-c", &server_code])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = [0u8; 6];
    server.stdout.take().unwrap().read_exact(&mut ready).unwrap();
    let client_code = format!(
        "import socket,time\nc=socket.create_connection(('127.0.0.1',{port}))\n\
         for i in range(200):\n c.sendall(b'%05d' % i)\n got=b''\n \
         while len(got)<5: got+=c.recv(5-len(got))\n assert got==b'%05d' % i, got\n time.sleep(0.002)\nc.close()\nprint('done')\n"
    );
    let mut client = Command::new(lightpath())
        .args(["run", "--report"])
        .arg(&report)
        .args(["--", "python3", "-c", &client_code])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = client.stdin.take().unwrap().write_all(b"");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = client.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = client.kill();
            let _ = server.kill();
            panic!("the client did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = server.wait();
    assert!(status.success());
    let text = std::fs::read_to_string(&report).unwrap_or_default();
    let shm_lines: Vec<&str> = text.lines().filter(|l| l.contains("transport=rdma/shm")).collect();
    assert_eq!(shm_lines.len(), 2, "both ends report an shm connection:\n{text}");
    for line in shm_lines {
        let rdma_in: u64 = line.split(" rdma_in=").nth(1).unwrap().trim().parse().unwrap();
        assert!(rdma_in > 0, "no bytes came over shm: {line}");
    }
}
