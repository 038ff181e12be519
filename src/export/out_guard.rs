//! What a run (or an import) may remove, decided before any work. A run removes three folders: `--out`
//! itself with `--force` (at publish), its `.NAME.partial` sibling (at the start, unless `--resume` keeps
//! it) and `.NAME.old` (left by a publish that was killed). None of them may be, hold or lie inside an
//! input (the model folder, the calibration text, a GGUF file), and none may be anything but a real folder:
//! `--force` replaced the model when `--out` was the model or a parent of it, and onto a regular file it
//! failed only at publish, after all the work.

use super::hf_folder::{old_path, partial_path};
use crate::error::file_err;
use std::path::{Component, Path, PathBuf};

/// An input that nothing the run removes may touch, with the words that name it in an error.
pub struct Input<'a> {
    pub path: &'a Path,
    pub what: &'static str,
}

/// Checks `out` for a run that will write `out`'s partial folder and publish it as `out` (replacing an
/// existing folder when `force`).
pub fn check_out(out: &Path, force: bool, inputs: &[Input<'_>]) -> anyhow::Result<()> {
    if !matches!(out.components().next_back(), Some(Component::Normal(_))) {
        return Err(crate::input_err!(
            "--out {} must end in a folder name (not `.`, `..` or `/`): the output is built beside it and \
             renamed into place",
            out.display()
        ));
    }
    let inputs: Vec<(PathBuf, &Input)> = inputs
        .iter()
        .filter_map(|i| std::fs::canonicalize(i.path).ok().map(|c| (c, i)))
        .collect();
    let exists = std::fs::symlink_metadata(out).is_ok();
    if exists && !force {
        return Err(file_err(
            out,
            "already exists; choose another --out or pass --force to replace it",
        ));
    }
    if exists {
        removable(out, &inputs)
            .map_err(|m| file_err(out, format!("{m} (--force replaces --out)")))?;
    }
    for (path, role) in [
        (partial_path(out), "the partial folder"),
        (old_path(out), "the folder an earlier --force set aside"),
    ] {
        if std::fs::symlink_metadata(&path).is_ok() {
            removable(&path, &inputs).map_err(|m| {
                file_err(
                    &path,
                    format!(
                        "{role} of --out {}, which a run replaces, {m}",
                        out.display()
                    ),
                )
            })?;
        }
    }
    Ok(())
}

/// Why `path` (which exists) may not be removed: anything but a real folder, an input, a folder holding one
/// or lying inside one.
fn removable(path: &Path, inputs: &[(PathBuf, &Input)]) -> Result<(), String> {
    let md = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    if md.file_type().is_symlink() {
        return Err(
            "is a symbolic link, not a folder: only a real folder is replaced (remove the link \
                    yourself)"
                .into(),
        );
    }
    if !md.is_dir() {
        return Err(
            "exists and is not a folder: only a folder is replaced (remove it yourself)".into(),
        );
    }
    let c = std::fs::canonicalize(path).map_err(|e| e.to_string())?;
    for (input, i) in inputs {
        let relation = if *input == c {
            "is"
        } else if input.starts_with(&c) {
            "holds"
        } else if c.starts_with(input) {
            "is inside"
        } else {
            continue;
        };
        return Err(format!(
            "{relation} {} ({}): replacing it would delete an input",
            i.what,
            i.path.display()
        ));
    }
    Ok(())
}
