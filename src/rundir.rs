//! Names: the per-user runtime directory, the server's socket and lock file,
//! and the POSIX shared-memory object name.

use crate::error::{Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Environment variable that overrides the runtime directory.
pub const RUNTIME_DIR_ENV: &str = "KVRING_RUNTIME_DIR";
/// Server name used when none is given.
pub const DEFAULT_NAME: &str = "default";

/// Checks a server name: 1-64 of `[A-Za-z0-9_.-]`, not starting with '.'.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName(name.to_string()))
    }
}

/// `file`'s metadata, if this user owns it (`WrongOwner` naming `name`
/// otherwise): shared memory of another user is never attached.
pub fn owned_metadata(name: &str, file: &std::fs::File) -> Result<std::fs::Metadata> {
    let md = file
        .metadata()
        .map_err(crate::error::io(format!("fstat {name}")))?;
    let me = euid();
    if md.uid() != me {
        return Err(Error::WrongOwner {
            name: name.into(),
            owner: md.uid(),
            me,
        });
    }
    Ok(md)
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Where this user's sockets and lock files live: `$KVRING_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/kvring`, else `/tmp/kvring-UID`. Not created.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(RUNTIME_DIR_ENV) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("kvring");
    }
    PathBuf::from(format!("/tmp/kvring-{}", euid()))
}

/// Creates the runtime directory (mode 0700) if needed and checks it is ours
/// and closed to others.
pub fn ensure_runtime_dir(dir: &Path) -> Result<()> {
    let err = |reason: String| Error::RuntimeDir {
        path: dir.display().to_string(),
        reason,
    };
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) => return Err(err(format!("cannot create: {e}"))),
    }
    check_runtime_dir(dir)
}

/// Checks an existing runtime directory: a directory (not a link), owned by
/// this user, with no access for group or others.
pub fn check_runtime_dir(dir: &Path) -> Result<()> {
    let err = |reason: String| Error::RuntimeDir {
        path: dir.display().to_string(),
        reason,
    };
    let md = std::fs::symlink_metadata(dir).map_err(|e| err(format!("cannot stat: {e}")))?;
    if !md.is_dir() {
        return Err(err("not a directory".into()));
    }
    if md.uid() != euid() {
        return Err(err(format!(
            "owned by uid {}, not by uid {}",
            md.uid(),
            euid()
        )));
    }
    if md.permissions().mode() & 0o077 != 0 {
        return Err(err(format!(
            "mode {:o} lets other users in; it must be 0700",
            md.permissions().mode() & 0o777
        )));
    }
    Ok(())
}

/// Paths of one server's files.
#[derive(Clone, Debug)]
pub struct ServerPaths {
    pub name: String,
    pub dir: PathBuf,
    /// Bootstrap socket.
    pub socket: PathBuf,
    /// Start-up lock, held by the running server.
    pub lock: PathBuf,
    /// The HTTP endpoint's admin token (mode 0600), written at the start
    /// and removed at a clean stop: who can read it may make admin calls.
    pub admin_token: PathBuf,
    /// POSIX shm object name (with the leading '/').
    pub shm_name: String,
}

impl ServerPaths {
    /// Paths for server `name` in the default runtime directory.
    pub fn new(name: &str) -> Result<ServerPaths> {
        Self::in_dir(name, &runtime_dir())
    }

    /// Paths for server `name` in runtime directory `dir`.
    pub fn in_dir(name: &str, dir: &Path) -> Result<ServerPaths> {
        check_name(name)?;
        Ok(ServerPaths {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            socket: dir.join(format!("{name}.sock")),
            lock: dir.join(format!("{name}.lock")),
            admin_token: dir.join(format!("{name}.admin-token")),
            shm_name: shm_name(name),
        })
    }
}

/// Prefix of every kvring shm object of this user.
pub fn shm_prefix() -> String {
    format!("kvring-{}-", euid())
}

/// The shm object name for server `name`: `/kvring-UID-NAME`.
pub fn shm_name(name: &str) -> String {
    format!("/{}{name}", shm_prefix())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name("default").is_ok());
        assert!(check_name("a.b-c_9").is_ok());
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn runtime_dir_must_be_private() {
        let d = std::env::temp_dir().join(format!("kvring-rd-{}", std::process::id()));
        ensure_runtime_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = check_runtime_dir(&d).unwrap_err().to_string();
        assert!(e.contains("0700"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
