//! The lock on an output folder, held for a whole run (or import): a second process on the same `--out`
//! is refused at once, naming the first, instead of replacing its `.NAME.partial` folder while it writes.
//!
//! The lock is the kernel's: `flock(LOCK_EX | LOCK_NB)` on `.NAME.lock` beside `--out`. The kernel drops
//! it when its holder dies, however it dies (`kill -9`, power loss aside: then nothing runs), so a stale
//! lock file is taken over by the next run without guessing from pids; the pid written into the file is
//! only there to name the holder. Any spelling of the same folder (`a/../out`, a symlinked parent) reaches
//! the same inode and so the same lock. flock works on local file systems and, through the NFS client's
//! emulation with fcntl locks, on NFS.
//!
//! The holder removes the file when it is done, while still holding the lock. A process that opened the
//! file just before that removal then locks an inode no path names any more; it checks, after locking,
//! that the path still leads to its inode, and starts over if not, so two runs never both hold "the" lock.

use crate::error::file_err;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Held while it lives; dropping it removes the lock file and releases the lock.
pub struct OutLock {
    path: PathBuf,
    _file: File,
}

/// `.NAME.lock` next to `out`.
pub fn lock_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    out.with_file_name(format!(".{name}.lock"))
}

impl OutLock {
    /// Takes the lock of `out`, creating its parent folder if needed. Refuses, naming the holder's pid,
    /// when another process holds it.
    pub fn acquire(out: &Path) -> anyhow::Result<OutLock> {
        let path = lock_path(out);
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.exists()
        {
            std::fs::create_dir_all(parent)
                .map_err(|e| file_err(parent, format!("cannot create the output folder: {e}")))?;
        }
        loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(&path)
                .map_err(|e| {
                    file_err(
                        &path,
                        format!("cannot create the output folder's lock file: {e}"),
                    )
                })?;
            // SAFETY: flock on a descriptor this function owns; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(file_err(
                        out,
                        format!(
                            "another boa-cuda run ({}) is writing this output (lock {}); wait for it to \
                             finish or choose another --out",
                            holder(&mut file),
                            path.display()
                        ),
                    ));
                }
                return Err(file_err(&path, format!("cannot lock: {e}")));
            }
            let ours = file
                .metadata()
                .map_err(|e| file_err(&path, format!("cannot stat: {e}")))?;
            match std::fs::metadata(&path) {
                Ok(now) if now.ino() == ours.ino() && now.dev() == ours.dev() => {}
                // The previous holder removed the file between our open and our lock: try again.
                _ => continue,
            }
            file.set_len(0)
                .and_then(|()| file.rewind())
                .and_then(|()| writeln!(file, "{}", std::process::id()))
                .map_err(|e| file_err(&path, format!("cannot write the lock file: {e}")))?;
            return Ok(OutLock { path, _file: file });
        }
    }
}

/// "pid N" from a lock file, as well as it can be read (the holder may not have written it yet).
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.rewind().and_then(|()| file.read_to_string(&mut text));
    match text.trim().parse::<u32>() {
        Ok(pid) => format!("pid {pid}"),
        Err(_) => "pid not yet recorded".into(),
    }
}

impl Drop for OutLock {
    fn drop(&mut self) {
        // Removed while the lock is still held (the file closes after this body): see the module doc.
        let _ = std::fs::remove_file(&self.path);
    }
}
