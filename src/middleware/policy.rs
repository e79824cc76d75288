//! What a run's checkpoint keeps: include and exclude globs (gitignore style), a largest
//! file, a byte budget, and secret scrubbing; and the workspace definition's hash.

use crate::sys::Locked;
use std::fs::File;
use std::io::Read;
use std::sync::Mutex;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use super::error::{MiddlewareError, MiddlewareResult};
use super::secrets::Secrets;
use crate::cas::{EntryContent, TreeEntry};
use crate::checkpoint::SecretFile;
use crate::fs::{EntryKind, FilterError, SnapshotFilter};

/// What to do with a file over `max_file_size`, or one that would take the checkpoint
/// past `max_total_bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Oversize {
    /// Leave it out and report it with the checkpoint's outcome.
    #[default]
    Skip,
    /// Fail the capture: nothing is published.
    Fail,
}

/// The capture policy of a workspace.
///
/// Globs are gitignore style: a pattern without `/` matches a name at any depth
/// (`*.log`, `node_modules`), one with `/` matches from the workspace root
/// (`/build/out`, `docs/*.md`), and a trailing `/` matches directories only. An
/// excluded directory is left out whole. With include patterns, only files matching
/// one of them go in (directories are entered unless excluded).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotPolicy {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub max_file_size: Option<u64>,
    /// The most bytes of changed files one checkpoint takes in (a checkpoint of a mount
    /// reads only what changed, so this bounds what a run adds, not the tree).
    pub max_total_bytes: Option<u64>,
    pub oversize: Oversize,
    /// Restore a checkpoint made for another workspace definition.
    pub allow_workspace_mismatch: bool,
}

/// The hash of a workspace definition (any JSON the host uses to describe it: image,
/// setup, policy, secret names), recorded in each checkpoint.
pub fn workspace_hash(definition: &serde_json::Value) -> String {
    // serde_json's maps are sorted: the same definition, the same bytes.
    let bytes = serde_json::to_vec(definition).expect("JSON values serialize");
    crate::cas::Hash::of(&bytes).to_hex()
}

struct Matcher {
    any: GlobSet,
    dirs_only: GlobSet,
}

impl Matcher {
    fn new(patterns: &[String], what: &str) -> MiddlewareResult<Option<Matcher>> {
        if patterns.is_empty() {
            return Ok(None);
        }
        let mut any = GlobSetBuilder::new();
        let mut dirs_only = GlobSetBuilder::new();
        for p in patterns {
            let (body, dir_only) = match p.strip_suffix('/') {
                Some(b) => (b, true),
                None => (p.as_str(), false),
            };
            let glob = match body.strip_prefix('/') {
                Some(anchored) => anchored.to_string(),
                None if body.contains('/') => body.to_string(),
                None => format!("**/{body}"),
            };
            if body.is_empty() {
                return Err(MiddlewareError::Config(format!(
                    "{what} pattern {p:?} is empty"
                )));
            }
            let g = Glob::new(&glob)
                .map_err(|e| MiddlewareError::Config(format!("{what} pattern {p:?}: {e}")))?;
            if dir_only {
                dirs_only.add(g);
            } else {
                any.add(g);
            }
        }
        let build = |b: GlobSetBuilder| {
            b.build()
                .map_err(|e| MiddlewareError::Config(format!("{what} patterns: {e}")))
        };
        Ok(Some(Matcher {
            any: build(any)?,
            dirs_only: build(dirs_only)?,
        }))
    }

    fn matches(&self, path: &str, is_dir: bool) -> bool {
        self.any.is_match(path) || (is_dir && self.dirs_only.is_match(path))
    }
}

/// A policy ready to filter one capture; it records what it left out and which files
/// held secrets.
pub(crate) struct CaptureFilter<'a> {
    include: Option<Matcher>,
    exclude: Option<Matcher>,
    policy: &'a SnapshotPolicy,
    secrets: &'a Secrets,
    state: Mutex<FilterState>,
}

#[derive(Default)]
pub(crate) struct FilterState {
    pub skipped: Vec<String>,
    pub oversize: Option<String>,
    pub bytes: u64,
    pub secret_files: Vec<SecretFile>,
    /// Why the capture was refused (a secret value in a name, target or xattr).
    pub refused: Option<String>,
}

impl<'a> CaptureFilter<'a> {
    pub fn new(policy: &'a SnapshotPolicy, secrets: &'a Secrets) -> MiddlewareResult<Self> {
        Ok(CaptureFilter {
            include: Matcher::new(&policy.include, "include")?,
            exclude: Matcher::new(&policy.exclude, "exclude")?,
            policy,
            secrets,
            state: Mutex::new(FilterState::default()),
        })
    }

    pub fn into_state(self) -> FilterState {
        self.state.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    /// A look at what the filter has seen so far.
    pub fn peek<T>(&self, f: impl FnOnce(&FilterState) -> T) -> T {
        f(&self.state())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FilterState> {
        self.state.locked()
    }
}

/// The largest file read whole to look for secret values.
const MAX_SCRUB_BYTES: u64 = 1 << 30;

impl SnapshotFilter for CaptureFilter<'_> {
    fn keep(&self, path: &str, kind: EntryKind, size: u64) -> bool {
        let is_dir = kind == EntryKind::Dir;
        if self
            .exclude
            .as_ref()
            .is_some_and(|m| m.matches(path, is_dir))
        {
            return false;
        }
        if !is_dir {
            if let Some(inc) = &self.include {
                if !inc.matches(path, false) {
                    return false;
                }
            }
        }
        if kind != EntryKind::File {
            return true;
        }
        let mut st = self.state();
        let over_file = self.policy.max_file_size.is_some_and(|m| size > m);
        let over_total = self
            .policy
            .max_total_bytes
            .is_some_and(|m| st.bytes.saturating_add(size) > m);
        if over_file || over_total {
            let why = if over_file {
                format!(
                    "{path}: {size} bytes, over the largest file of {} bytes",
                    self.policy.max_file_size.unwrap_or(0)
                )
            } else {
                format!(
                    "{path}: {size} bytes would take the checkpoint over its {} bytes",
                    self.policy.max_total_bytes.unwrap_or(0)
                )
            };
            if self.policy.oversize == Oversize::Fail && st.oversize.is_none() {
                st.oversize = Some(why);
            }
            st.skipped.push(path.to_string());
            return false;
        }
        st.bytes += size;
        true
    }

    /// Names, symlink targets and extended attributes are stored as they are, so one
    /// holding a secret value refuses the capture (docs/middleware.md says why): the
    /// error names the entry with the value replaced by its placeholder.
    fn vet(&self, dir: &str, entry: &TreeEntry) -> Result<(), FilterError> {
        if self.secrets.is_empty() {
            return Ok(());
        }
        let Some((what, secret)) = self.secret_in(entry) else {
            return Ok(());
        };
        let name = String::from_utf8_lossy(&entry.name);
        let path = if dir.is_empty() {
            name.into_owned()
        } else {
            format!("{dir}/{name}")
        };
        let why = format!(
            "the {what} of {:?} holds the value of secret {secret}; casfs stores names, \
             symlink targets and extended attributes as they are, so it refuses to capture \
             them: rename, remove or exclude the entry",
            self.secrets.scrub_str(&path)
        );
        let mut st = self.state();
        if st.refused.is_none() {
            st.refused = Some(why.clone());
        }
        Err(FilterError::Refused(why))
    }

    fn transform(
        &self,
        path: &str,
        file: &mut File,
        size: u64,
    ) -> Result<Option<Vec<u8>>, FilterError> {
        if let Some(why) = &self.state().oversize {
            // Fail early: nothing of this capture will be published.
            return Err(FilterError::Refused(format!("oversize file: {why}")));
        }
        if self.secrets.is_empty() {
            return Ok(None);
        }
        if size > MAX_SCRUB_BYTES {
            return Err(FilterError::Refused(format!(
                "{size} bytes: too large to look for secret values in (exclude it or set \
                 max_file_size)"
            )));
        }
        let mut data = Vec::with_capacity(size as usize);
        file.read_to_end(&mut data)?;
        Ok(self.secrets.scrub(&data).map(|(out, names)| {
            self.state().secret_files.push(SecretFile {
                path: path.to_string(),
                secrets: names,
            });
            out
        }))
    }
}

impl CaptureFilter<'_> {
    /// A secret value in an entry's name, symlink target or extended attribute (name or
    /// value): where and which, without the value.
    fn secret_in(&self, entry: &TreeEntry) -> Option<(&'static str, &str)> {
        let s = self.secrets;
        if let Some(n) = s.found_in(&entry.name) {
            return Some(("name", n));
        }
        if let EntryContent::Symlink(t) = &entry.content {
            if let Some(n) = s.found_in(t) {
                return Some(("symlink target", n));
            }
        }
        for (k, v) in &entry.xattrs {
            if let Some(n) = s.found_in(k).or_else(|| s.found_in(v)) {
                return Some(("extended attribute", n));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(p: &SnapshotPolicy) -> CaptureFilter<'_> {
        static NONE: std::sync::OnceLock<Secrets> = std::sync::OnceLock::new();
        CaptureFilter::new(p, NONE.get_or_init(Secrets::default)).unwrap()
    }

    #[test]
    fn gitignore_style_globs() {
        let p = SnapshotPolicy {
            exclude: vec![
                "node_modules".into(),
                "*.log".into(),
                "/build".into(),
                "cache/".into(),
            ],
            ..Default::default()
        };
        let f = filter(&p);
        assert!(!f.keep("node_modules", EntryKind::Dir, 0));
        assert!(!f.keep("a/b/node_modules", EntryKind::Dir, 0));
        assert!(!f.keep("x.log", EntryKind::File, 1));
        assert!(!f.keep("deep/er/x.log", EntryKind::File, 1));
        assert!(!f.keep("build", EntryKind::Dir, 0));
        assert!(f.keep("src/build", EntryKind::Dir, 0));
        assert!(!f.keep("a/cache", EntryKind::Dir, 0));
        assert!(f.keep("a/cache", EntryKind::File, 1));
        assert!(f.keep("src/main.rs", EntryKind::File, 1));
    }

    #[test]
    fn include_limits_files_not_directories() {
        let p = SnapshotPolicy {
            include: vec!["*.rs".into(), "/Cargo.toml".into()],
            ..Default::default()
        };
        let f = filter(&p);
        assert!(f.keep("src", EntryKind::Dir, 0));
        assert!(f.keep("src/lib.rs", EntryKind::File, 1));
        assert!(f.keep("Cargo.toml", EntryKind::File, 1));
        assert!(!f.keep("sub/Cargo.toml", EntryKind::File, 1));
        assert!(!f.keep("README.md", EntryKind::File, 1));
    }

    #[test]
    fn sizes_skip_or_fail() {
        let p = SnapshotPolicy {
            max_file_size: Some(10),
            max_total_bytes: Some(15),
            ..Default::default()
        };
        let f = filter(&p);
        assert!(f.keep("a", EntryKind::File, 10));
        assert!(!f.keep("big", EntryKind::File, 11));
        assert!(f.keep("b", EntryKind::File, 5));
        assert!(!f.keep("c", EntryKind::File, 1));
        let st = f.into_state();
        assert_eq!(st.skipped, vec!["big".to_string(), "c".to_string()]);
        assert!(st.oversize.is_none());
        let p = SnapshotPolicy {
            max_file_size: Some(10),
            oversize: Oversize::Fail,
            ..Default::default()
        };
        let f = filter(&p);
        assert!(!f.keep("big", EntryKind::File, 11));
        assert!(f.into_state().oversize.unwrap().contains("big: 11 bytes"));
    }

    #[test]
    fn bad_globs_are_named() {
        let p = SnapshotPolicy {
            exclude: vec!["a[".into()],
            ..Default::default()
        };
        let e = CaptureFilter::new(&p, &Secrets::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("exclude pattern \"a[\""), "{e}");
    }

    #[test]
    fn workspace_hash_is_stable() {
        let a = serde_json::json!({"image": "x", "setup": ["a", "b"]});
        let b: serde_json::Value =
            serde_json::from_str(r#"{"setup": ["a", "b"], "image": "x"}"#).unwrap();
        assert_eq!(workspace_hash(&a), workspace_hash(&b));
        assert_ne!(
            workspace_hash(&a),
            workspace_hash(&serde_json::json!({"image": "y"}))
        );
    }
}
