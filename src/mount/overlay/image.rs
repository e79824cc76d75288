//! The lower's metadata as an EROFS image ([`crate::fs::erofs`]): built once per tree,
//! kept under `<store>/images/<tree id>.erofs`, mounted by the kernel (file-backed
//! EROFS) as the overlay's metadata layer, with casfs's object view as the data-only
//! layer below it (`lowerdir=<image>::<objects>`). Lookups, listings and stats of the
//! base then never reach casfs; only file contents do, when opened.
//!
//! A mount builds the image of its tree before mounting when there is none (the tree
//! is walked once: O(entries), see docs/mount.md for the cost); a restore uses the
//! image when there is one and otherwise mounts the tree's view, never building one
//! (O(1) at any size; an image written in the background meanwhile, fsync included,
//! made checkpoints and restores on the same filesystem wait for it: 17-39 ms instead
//! of 3-7 at 100k files). An image names the owner of every file in it: a workspace
//! made for another user (`casfs serve`'s caller) has its own image of the tree,
//! `<tree id>.<uid>-<gid>.erofs` (root's is `<tree id>.erofs`). A tree the format cannot hold is marked
//! (`<tree id>.unsupported`, with the reason) and always served by the view.
//! `CASFS_OVERLAY_LOWER=view` turns images off. Images of trees gc has collected are
//! removed before the next build.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::cas::TreeId;
use crate::checkpoint::{image_name, image_tree, unsupported_image_name, Store};
pub(super) use crate::fs::erofs::mount_image;
use crate::fs::erofs::{write_image, ImageError};
use crate::fs::Owner;

/// Whether overlay mounts use images (`CASFS_OVERLAY_LOWER`: `image`, the default, or
/// `view`).
pub(super) fn images_enabled() -> bool {
    std::env::var("CASFS_OVERLAY_LOWER").map_or(true, |v| v != "view")
}

fn images_dir(store: &Store) -> PathBuf {
    let root = std::fs::canonicalize(store.root()).unwrap_or_else(|_| store.root().to_path_buf());
    crate::checkpoint::images_dir(&root)
}

fn image_path(store: &Store, root: &TreeId, owner: Owner) -> PathBuf {
    images_dir(store).join(image_name(root, owner))
}

fn unsupported_path(store: &Store, root: &TreeId) -> PathBuf {
    images_dir(store).join(unsupported_image_name(root))
}

/// Builds the image of `root` with its files `owner`'s unless it exists or is known
/// impossible; returns whether it exists afterwards. Two builds of one tree at once
/// (two sandboxes mounted from one head) each write their own temporary file and rename
/// it into place.
fn build(store: &Store, root: TreeId, owner: Owner) -> bool {
    let path = image_path(store, &root, owner);
    if path.exists() {
        return true;
    }
    if unsupported_path(store, &root).exists() {
        return false;
    }
    let dir = images_dir(store);
    remove_dead_images(store, &dir);
    let start = Instant::now();
    let made = std::fs::create_dir_all(&dir)
        .map_err(|source| ImageError::Io {
            path: dir.display().to_string(),
            source,
        })
        .and_then(|_| write_image(store.objects(), &root, &path, owner.uid, owner.gid));
    match made {
        Ok(s) => {
            tracing::info!(
                "image of tree {}: {} inodes, {} bytes in {:?}",
                root.0.short(12),
                s.inodes,
                s.bytes,
                start.elapsed()
            );
            true
        }
        Err(ImageError::Unsupported(why)) => {
            tracing::info!("tree {} served by the view: {why}", root.0.short(12));
            let _ = std::fs::write(unsupported_path(store, &root), why);
            false
        }
        Err(e) => {
            tracing::warn!("building the image of tree {}: {e}", root.0.short(12));
            false
        }
    }
}

/// The image of `root` with its files `owner`'s, built now if missing and `build` (None
/// when it is missing and not to be built, or the tree cannot be one).
pub(super) fn image_for(
    store: &Store,
    root: TreeId,
    owner: Owner,
    build_missing: bool,
) -> Option<PathBuf> {
    let path = image_path(store, &root, owner);
    if path.exists() {
        return Some(path);
    }
    (build_missing && build(store, root, owner)).then_some(path)
}

/// Removes the images of trees the store no longer holds (collected by gc), and
/// temporary files of builds whose process died, before each build: images are a
/// cache, one per live tree mounted since.
fn remove_dead_images(store: &Store, dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        // A build's temporary file (`<tree>.erofs.<pid>-<n>.tmp`) whose process is gone.
        if let Some(rest) = name.strip_suffix(".tmp") {
            let pid = rest.rsplit('.').next().and_then(|p| p.split('-').next());
            let gone = pid.is_some_and(|p| !Path::new("/proc").join(p).exists());
            if gone {
                let _ = std::fs::remove_file(e.path());
            }
            continue;
        }
        let Some(tree) = image_tree(name) else {
            continue;
        };
        if crate::cas::load_tree(store.objects(), &tree).is_err() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
