//! Records the build profile, so that a run can say what it measured.

fn main() {
    for key in ["PROFILE", "OPT_LEVEL", "DEBUG"] {
        let value = std::env::var(key).unwrap_or_default();
        println!("cargo:rustc-env=KVRING_BENCH_{key}={value}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
