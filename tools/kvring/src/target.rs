//! Which server a command talks to: its name and runtime directory.

use clap::Args;

/// The server a command serves or talks to.
#[derive(Args, Clone, Debug)]
pub(crate) struct Target {
    /// Server name: one server per name and user on a host.
    #[arg(long, default_value = kvring::rundir::DEFAULT_NAME, env = "KVRING_NAME")]
    pub(crate) name: String,
    /// Directory for the bootstrap socket and lock file (mode 0700). Default:
    /// $KVRING_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvring, else /tmp/kvring-UID.
    #[arg(long)]
    runtime_dir: Option<std::path::PathBuf>,
}

impl Target {
    pub(crate) fn dir(&self) -> std::path::PathBuf {
        self.runtime_dir
            .clone()
            .unwrap_or_else(kvring::rundir::runtime_dir)
    }
}
