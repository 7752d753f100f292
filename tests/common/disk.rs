//! The disk tier's test helpers: a directory of its own, and file systems
//! made for a test (a small tmpfs, an ext4 image on a loop device) where
//! the process may mount them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A directory for a disk tier, removed at the end of the test.
pub struct DiskDir(pub PathBuf);

impl DiskDir {
    pub fn new(tag: &str) -> DiskDir {
        DiskDir(std::env::temp_dir().join(format!("kvring-{tag}-{}", std::process::id())))
    }

    pub fn arg(&self) -> String {
        self.0.display().to_string()
    }

    pub fn segments(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "kvd"))
            .collect();
        v.sort();
        v
    }
}

impl Drop for DiskDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a command that must succeed.
fn sh(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A file system mounted for a test at a directory of its own, unmounted
/// (lazily, thawed first) and removed at the end.
pub struct Mounted {
    pub dir: PathBuf,
    image: Option<PathBuf>,
    frozen: bool,
}

impl Mounted {
    /// A tmpfs of `size` (e.g. `"1m"`).
    pub fn tmpfs(tag: &str, size: &str) -> Mounted {
        let dir = mount_point(tag);
        sh(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                path(&dir),
            ],
        );
        Mounted {
            dir,
            image: None,
            frozen: false,
        }
    }

    /// An ext4 file system of `mib` MiB in an image file, on a loop device.
    pub fn ext4(tag: &str, mib: u64) -> Mounted {
        let dir = mount_point(tag);
        let image = dir.with_extension("img");
        let f = std::fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        drop(f);
        sh("mkfs.ext4", &["-q", "-F", path(&image)]);
        sh("mount", &["-o", "loop", path(&image), path(&dir)]);
        Mounted {
            dir,
            image: Some(image),
            frozen: false,
        }
    }

    /// Freezes the file system: every write to it waits until [`Self::thaw`].
    pub fn freeze(&mut self) {
        sh("fsfreeze", &["-f", path(&self.dir)]);
        self.frozen = true;
    }

    pub fn thaw(&mut self) {
        if self.frozen {
            sh("fsfreeze", &["-u", path(&self.dir)]);
            self.frozen = false;
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.frozen {
            let _ = Command::new("fsfreeze")
                .args(["-u", path(&self.dir)])
                .status();
        }
        let _ = Command::new("umount")
            .args(["-l", path(&self.dir)])
            .status();
        let _ = std::fs::remove_dir(&self.dir);
        if let Some(i) = &self.image {
            let _ = std::fs::remove_file(i);
        }
    }
}

fn mount_point(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvring-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}
