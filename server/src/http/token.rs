//! The admin token: who may call the admin routes.

use super::Response;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// The admin token: 64 hex digits of 32 bytes from the OS's random
/// source, in a file only the server's user can read.
pub(super) struct AdminToken {
    hex: Vec<u8>,
    path: PathBuf,
}

impl AdminToken {
    /// Draws a token and writes it to `path` (mode 0600), replacing the
    /// file of a server that did not stop cleanly.
    pub(super) fn create(path: &Path) -> crate::Result<AdminToken> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let mut raw = [0u8; 32];
        os_random(&mut raw).map_err(kvring::error::io("draw the admin token"))?;
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let at = || format!("write the admin token {}", path.display());
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(kvring::error::io(at())(e)),
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(kvring::error::io(at()))?;
        // The umask may have taken bits away, never added any: exactly
        // 0600, so the server's user can read it back.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .and_then(|()| f.write_all(hex.as_bytes()))
            .map_err(kvring::error::io(at()))?;
        Ok(AdminToken {
            hex: hex.into_bytes(),
            path: path.to_path_buf(),
        })
    }

    /// Whether `given` is the token. The time taken does not depend on
    /// where they differ (only on whether the lengths do).
    pub(super) fn admits(&self, given: Option<&[u8]>) -> bool {
        let Some(given) = given else {
            return false;
        };
        if given.len() != self.hex.len() {
            return false;
        }
        let diff = given
            .iter()
            .zip(&self.hex)
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// The file it was written to.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The answer to an admin call without the token.
    pub(super) fn refusal(&self) -> Response {
        Response::text(
            401,
            &format!(
                "admin calls need the server's admin token: send \"Authorization: Bearer <token>\", \
                 the token being the contents of {} (readable by the server's user only)\n",
                self.path.display()
            ),
        )
    }
}

impl Drop for AdminToken {
    /// No admin call is taken with it any more: its file goes.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Fills `buf` from the OS's random source.
fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: getrandom writes at most `rest.len()` bytes to
        // `rest.as_mut_ptr()`, which points to that many writable bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_admitted_whole_only() {
        let dir = std::env::temp_dir().join(format!("kvring-token-{}", std::process::id()));
        kvring::rundir::ensure_runtime_dir(&dir).unwrap();
        let path = dir.join("t.admin-token");
        std::fs::write(&path, "stale").unwrap();
        let t = AdminToken::create(&path).unwrap();
        let text = std::fs::read(&path).unwrap();
        assert_eq!(text, t.hex);
        assert_eq!(text.len(), 64);
        assert!(t.admits(Some(&text)));
        assert!(!t.admits(None));
        assert!(!t.admits(Some(&text[..63])));
        let mut other = text.clone();
        other[0] ^= 1;
        assert!(!t.admits(Some(&other)));
        // Another token each time.
        let again = AdminToken::create(&path).unwrap();
        assert_ne!(again.hex, t.hex);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
