//! `kvring-inspect`: a read-only live and post-mortem view of a kvring
//! segment.

fn main() -> std::process::ExitCode {
    kvring_cli::inspect_cmd::main(std::env::args_os().collect())
}
