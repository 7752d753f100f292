//! The `kvring` and `kvring-inspect` command lines, as a library that the
//! two binaries of this package call (`kvring inspect ARGS` is
//! `kvring-inspect ARGS`). The Python wheel carries the `kvring` binary,
//! so `python -m kvring` runs this same program.

mod demo;
mod health;
pub mod inspect_cmd;
pub mod kvring_cmd;
mod render;
mod serve;
mod target;

/// Parses a command line; on `--help`, `--version` or an error, prints
/// what clap says and gives the exit status (0, or 2 for a usage error).
fn parse<C: clap::Parser>(args: Vec<std::ffi::OsString>) -> Result<C, std::process::ExitCode> {
    C::try_parse_from(args).map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            std::process::ExitCode::from(2)
        } else {
            std::process::ExitCode::SUCCESS
        }
    })
}
