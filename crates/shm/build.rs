//! Declares the `loom` cfg, set only for the model check (`RUSTFLAGS="--cfg loom"`).
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
