//! Names the commit the binary is built from, for `casfs --version`:
//! `casfs 0.1.0 (commit 0546df917bbc)`, the commit followed by `-modified` when the
//! sources that make the binary differ from it. Without git (a source tarball, or a
//! tree that is not its own repository) the commit is `unknown`, unless
//! `CASFS_GIT_COMMIT` in the environment names it (a packager who knows).

use std::path::{Path, PathBuf};
use std::process::Command;

/// What the binary is made of: a change here is a change of the binary.
const SOURCES: &[&str] = &["src", "build.rs", "Cargo.toml", "Cargo.lock", "third_party"];

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

/// Reruns this script when `p` changes; a path that does not exist is not named (cargo
/// would rerun the script at every build).
fn watch(p: &Path) {
    if p.exists() {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

fn from_git(dir: &Path) -> Option<String> {
    // Only the repository whose top is this package, not one it happens to sit in.
    let top = PathBuf::from(git(dir, &["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != dir.canonicalize().ok()? {
        return None;
    }
    let commit = git(dir, &["rev-parse", "--short=12", "HEAD"])?;
    // HEAD moves: HEAD itself (a worktree has its own), the branch it names, and the
    // packed refs of the common directory.
    let git_dir = PathBuf::from(git(dir, &["rev-parse", "--absolute-git-dir"])?);
    watch(&git_dir.join("HEAD"));
    if let Some(common) = git(dir, &["rev-parse", "--git-common-dir"]) {
        let common = dir.join(common);
        watch(&common.join("packed-refs"));
        if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"]) {
            watch(&common.join(branch));
        }
    }
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend_from_slice(SOURCES);
    let modified = !git(dir, &status)?.is_empty();
    Some(if modified {
        format!("{commit}-modified")
    } else {
        commit
    })
}

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-env-changed=CASFS_GIT_COMMIT");
    for s in SOURCES {
        watch(&dir.join(s));
    }
    let commit = match std::env::var("CASFS_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => from_git(&dir).unwrap_or_else(|| "unknown".into()),
    };
    println!("cargo:rustc-env=CASFS_COMMIT={commit}");
}
