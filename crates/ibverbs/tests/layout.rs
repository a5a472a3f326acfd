//! Checks the hand-written mirrors of libibverbs' structures and constants against rdma-core's
//! real `<infiniband/verbs.h>`: a C program compiled with the system's C compiler prints every
//! `sizeof`, `offsetof` and constant in `ffi::layout::rust_layout()`, and each must equal the
//! value the Rust side uses.
//!
//! Where the header or a C compiler is missing (machines without libibverbs-dev), the test says
//! so and passes without checking; `LIGHTPATH_REQUIRE_VERBS_HEADERS=1` makes that a failure.

use std::path::Path;
use std::process::Command;

use lightpath_ibverbs::ffi::layout::rust_layout;

const HEADER: &str = "/usr/include/infiniband/verbs.h";

fn skip(reason: &str) {
    if std::env::var("LIGHTPATH_REQUIRE_VERBS_HEADERS").is_ok_and(|v| v == "1") {
        panic!("layout check cannot run: {reason}");
    }
    println!("layout check skipped: {reason}");
}

#[test]
fn structures_and_constants_match_verbs_h() {
    if !Path::new(HEADER).exists() {
        return skip(&format!("{HEADER} is not installed (apt-get install libibverbs-dev)"));
    }
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let facts = rust_layout();
    let mut program = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    for fact in &facts {
        program.push_str(&format!("    printf(\"%llu\\n\", (unsigned long long)({}));\n", fact.c_expr));
    }
    program.push_str("    return 0;\n}\n");
    let dir = std::env::temp_dir().join(format!("lightpath-ibverbs-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let source = dir.join("layout.c");
    let binary = dir.join("layout");
    std::fs::write(&source, &program).expect("write the C program");
    let compiled = match Command::new(&compiler).arg("-o").arg(&binary).arg(&source).output() {
        Ok(output) => output,
        Err(err) => return skip(&format!("no C compiler ({compiler}: {err})")),
    };
    assert!(
        compiled.status.success(),
        "the layout program does not compile against {HEADER}:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&binary).output().expect("run the layout program");
    assert!(run.status.success());
    let stdout = String::from_utf8(run.stdout).expect("UTF-8 output");
    let c_values: Vec<u64> = stdout.lines().map(|line| line.parse().expect("a number per line")).collect();
    assert_eq!(c_values.len(), facts.len());
    let mismatches: Vec<String> = facts
        .iter()
        .zip(&c_values)
        .filter(|(fact, c)| fact.rust != **c)
        .map(|(fact, c)| format!("{}: C says {c}, Rust uses {}", fact.label, fact.rust))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(mismatches.is_empty(), "layout mismatches:\n{}", mismatches.join("\n"));
    println!("{} sizes, offsets and constants match {HEADER}", facts.len());
}
