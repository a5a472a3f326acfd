//! The C ABI from C: `tests/c/collectives.c` is compiled against `include/lightpath_coll.h`
//! and `liblightpath_coll.so` with the system's C compiler (warnings are errors), then run as
//! the ranks of a job by the collectives' launcher (`lightpath launch` does the same). The
//! header is also compiled as C++, and the examples are compiled and run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lightpath_collectives::launch::{launch, LaunchOptions};

/// `target/<profile>`, where cargo puts the shared library.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// Builds the shared library (integration tests do not make cargo build a cdylib), once;
/// returns the directory it is in.
fn library() -> PathBuf {
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
            dir
        })
        .clone()
}

/// Compiles the C file `source` of this crate into `name` with the system's C compiler
/// (warnings are errors), linked with the library; returns its path.
fn compile(source: &str, name: &str) -> PathBuf {
    let dir = library();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let output = Command::new("cc")
        .args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join(source))
        .arg("-L")
        .arg(&dir)
        .arg("-llightpath_coll")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-o")
        .arg(&out)
        .output()
        .expect("running cc (a C compiler is needed to test the C ABI)");
    assert!(output.status.success(), "cc {source} failed:\n{}", String::from_utf8_lossy(&output.stderr));
    out
}

/// The test program, `tests/c/collectives.c`, compiled once.
fn program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| compile("tests/c/collectives.c", "lightpath_coll_c_test")).clone()
}

/// Runs the program as `ranks` ranks in `mode`; returns whether every rank succeeded.
fn run(ranks: usize, mode: &str, env: &[(&str, &str)]) -> bool {
    run_program(&program(), ranks, &[mode], env)
}

fn run_program(program: &Path, ranks: usize, args: &[&str], env: &[(&str, &str)]) -> bool {
    let mut opts = LaunchOptions::new(ranks);
    opts.grace = Duration::from_secs(20);
    opts.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let outcome = launch(program.to_str().expect("a UTF-8 path"), &args, &opts).expect("launch");
    eprintln!("{} {args:?} x{ranks}: {:?}", program.display(), outcome.statuses);
    outcome.statuses.iter().all(|s| s.success())
}

#[test]
fn the_examples_compile_and_run() {
    let allreduce = compile("examples/allreduce.c", "example_allreduce");
    assert!(run_program(&allreduce, 2, &[], &[]), "examples/allreduce.c failed (its message is above)");
    // The overlap example checks its sum itself; a smaller buffer keeps the test short.
    let overlap = compile("examples/overlap.c", "example_overlap");
    assert!(run_program(&overlap, 2, &["100003"], &[]), "examples/overlap.c failed (its message is above)");
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
fn a_rank_that_leaves_fails_the_others_pending_requests_naming_it() {
    assert!(
        run(3, "die-nonblocking", &[("LIGHTPATH_COLL_TIMEOUT_MS", "2000")]),
        "a rank failed (its message is above)"
    );
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
