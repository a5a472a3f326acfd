//! The C ABI from C: `tests/c/collectives.c` is compiled against `include/lightpath_coll.h`
//! and `liblightpath_coll.so` with the system's C compiler (warnings are errors), then run as
//! the ranks of a job by the collectives' launcher (`lightpath launch` does the same). The
//! header is also compiled as C++.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lightpath_collectives::launch::{launch, LaunchOptions};

/// `target/<profile>`, where cargo puts the shared library.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// Builds the shared library (integration tests do not make cargo build a cdylib) and the C
/// program; returns the program's path.
fn program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = profile_dir();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build.args(["build", "-q", "-p", "lightpath-collectives-c"]);
            if dir.ends_with("release") {
                build.arg("--release");
            }
            assert!(
                build.status().expect("cargo build").success(),
                "cargo build -p lightpath-collectives-c failed"
            );
            assert!(
                dir.join("liblightpath_coll.so").is_file(),
                "no liblightpath_coll.so in {}",
                dir.display()
            );
            let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("lightpath_coll_c_test");
            let output = Command::new("cc")
                .args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-I"])
                .arg(crate_dir.join("include"))
                .arg(crate_dir.join("tests/c/collectives.c"))
                .arg("-L")
                .arg(&dir)
                .arg("-llightpath_coll")
                .arg(format!("-Wl,-rpath,{}", dir.display()))
                .arg("-o")
                .arg(&out)
                .output()
                .expect("running cc (a C compiler is needed to test the C ABI)");
            assert!(output.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&output.stderr));
            out
        })
        .clone()
}

/// Runs the program as `ranks` ranks in `mode`; returns whether every rank succeeded.
fn run(ranks: usize, mode: &str, env: &[(&str, &str)]) -> bool {
    let mut opts = LaunchOptions::new(ranks);
    opts.grace = Duration::from_secs(20);
    opts.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let program = program();
    let outcome =
        launch(program.to_str().expect("a UTF-8 path"), &[mode.to_string()], &opts).expect("launch");
    eprintln!("{mode} x{ranks}: {:?}", outcome.statuses);
    outcome.statuses.iter().all(|s| s.success())
}

#[test]
fn every_call_gives_the_reference_result_from_c() {
    for ranks in [1, 2, 3] {
        assert!(run(ranks, "all", &[]), "a rank of {ranks} failed (its message is above)");
    }
}

#[test]
fn bad_arguments_are_refused_with_a_message_and_nothing_is_sent() {
    assert!(run(2, "invalid", &[]), "a rank failed (its message is above)");
}

#[test]
fn a_rank_that_leaves_makes_the_others_fail_naming_it() {
    assert!(run(3, "die", &[("LIGHTPATH_COLL_TIMEOUT_MS", "2000")]), "a rank failed (its message is above)");
}

#[test]
fn the_header_compiles_as_cpp() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("c++")
        .args(["-std=c++11", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-x", "c++"])
        .arg(crate_dir.join("include/lightpath_coll.h"))
        .output()
        .expect("running c++");
    assert!(output.status.success(), "c++ failed:\n{}", String::from_utf8_lossy(&output.stderr));
}

#[test]
fn the_c_program_runs_under_open_mpi_mpirun() {
    let Some(mpirun) = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("mpirun")).find(|p| p.is_file()))
    else {
        eprintln!("SKIPPED: mpirun not found (scripts/ci-deps/collectives.sh installs Debian's openmpi-bin)");
        return;
    };
    let out = Command::new(mpirun)
        .args(["--oversubscribe", "-n", "3", "-x", "LIGHTPATH_COLL_TIMEOUT_MS=20000"])
        .arg(program())
        .arg("all")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("running mpirun");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches("of 3: all ok").count(), 3, "{text}");
}
