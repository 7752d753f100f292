//! `kvring`: the cache server and a few client commands.

fn main() -> std::process::ExitCode {
    kvring_cli::kvring_cmd::main(std::env::args_os().collect())
}
