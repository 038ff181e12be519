//! Reads the text of one file, a folder (its .txt files in name order), or a list of those, joined by blank
//! lines. Non-UTF-8 bytes are an error naming the file (a silently lossy decode would change the tokens).

use crate::error::file_err;
use std::path::{Path, PathBuf};

/// The files a list of paths names: files as given, folders expanded to their `*.txt` files sorted by name.
pub fn expand(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut inner: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| file_err(p, format!("cannot list: {e}")))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "txt"))
                .collect();
            inner.sort();
            if inner.is_empty() {
                return Err(file_err(p, "folder holds no .txt files"));
            }
            files.extend(inner);
        } else if p.is_file() {
            files.push(p.clone());
        } else {
            files.push(special_file(p)?);
        }
    }
    if files.is_empty() {
        return Err(crate::input_err!("no text files given"));
    }
    Ok(files)
}

/// A path that is neither a regular file nor a folder: a pipe (`--calib <(zcat a.gz)`, /dev/stdin) is read
/// once like a file; a device or socket is refused by its kind (/dev/zero would never end), and only a
/// path that does not exist is "no such file".
fn special_file(p: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let t = match std::fs::metadata(p) {
        Ok(m) => m.file_type(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(file_err(p, "no such file or folder"));
        }
        Err(e) => return Err(file_err(p, format!("cannot read: {e}"))),
    };
    let kind = if t.is_fifo() {
        return Ok(p.to_path_buf());
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(file_err(
        p,
        format!("is {kind}, not a text file, folder or pipe"),
    ))
}

pub fn read_file(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        file_err(
            path,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The concatenated text of `paths` (see `expand`), documents separated by "\n\n".
pub fn read_all(paths: &[PathBuf]) -> anyhow::Result<String> {
    let files = expand(paths)?;
    let mut out = String::new();
    for (i, f) in files.iter().enumerate() {
        if i > 0 {
            out.push_str("\n\n");
        }
        out.push_str(&read_file(f)?);
    }
    Ok(out)
}
