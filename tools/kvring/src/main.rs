//! `kvring`: the cache server and a few client commands.

fn main() -> std::process::ExitCode {
    let this = std::env::current_exe()
        .map(|p| vec![p.into_os_string()])
        .unwrap_or_else(|_| vec![std::env::args_os().next().unwrap_or_default()]);
    kvring_cli::kvring_cmd::main(std::env::args_os().collect(), this)
}
