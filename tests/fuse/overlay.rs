//! The two mount backends agree: one workload script (creates, modifies, deletes,
//! renames of base directories, a directory replaced, metadata-only changes, xattrs,
//! symlinks, a fifo, a hard link) run in a FUSE mount, in an overlay mount and in a
//! plain directory gives the same root tree, byte for byte. And what only the overlay
//! backend has: a restore in place while a process holds the old tree.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::common::*;
use crate::MountGuard;

/// The changes, as a shell script run in the workspace; every entry's times are then
/// set to one value (times differ between runs otherwise).
const WORKLOAD: &str = r#"
set -e
echo more >> a.txt
echo n > new.txt
mkdir -p newdir/deep && echo d > newdir/deep/f
rm -r gone
mv mvdir renamed
echo w2 > renamed/inner/w2
mv keep/sub/y keep/y-moved
rm keep/x
rm -r replace_dir && mkdir replace_dir && echo r > replace_dir/r
chmod 600 mode.sh
chmod 700 keep
python3 -c "import os; os.setxattr('xa', 'user.k', b'v2'); os.setxattr('keep', 'user.d', b'dir')"
ln -sf new.txt ln
mkfifo fifo
ln new.txt hard
mv big.bin big-moved.bin && printf tail >> big-moved.bin
ln xa xa-hard
mv mode.sh mode-moved.sh
echo t > tmp && rm tmp
mkdir emptied && rmdir emptied
find . -exec touch -h -d @1700000000 {} +
"#;

fn base(dir: &Path) {
    fs::create_dir_all(dir.join("keep/sub")).unwrap();
    fs::create_dir_all(dir.join("gone/g2")).unwrap();
    fs::create_dir_all(dir.join("mvdir/inner")).unwrap();
    fs::create_dir_all(dir.join("replace_dir")).unwrap();
    fs::write(dir.join("a.txt"), "A\n").unwrap();
    fs::write(dir.join("keep/x"), "x").unwrap();
    fs::write(dir.join("keep/sub/y"), "y").unwrap();
    fs::write(dir.join("gone/z"), "z").unwrap();
    fs::write(dir.join("gone/g2/z2"), "z2").unwrap();
    fs::write(dir.join("mvdir/inner/w"), "w").unwrap();
    fs::write(dir.join("replace_dir/q"), "q").unwrap();
    fs::write(dir.join("mode.sh"), "#!/bin/sh\n").unwrap();
    fs::write(dir.join("xa"), "xattrs").unwrap();
    set_xattr(&dir.join("xa"), "user.k", b"v");
    std::os::unix::fs::symlink("a.txt", dir.join("ln")).unwrap();
    fs::write(dir.join("big.bin"), pattern(3 << 20, 5)).unwrap();
}

fn run_workload(dir: &Path) {
    run_ok(
        Command::new("sh").arg("-c").arg(WORKLOAD).current_dir(dir),
        &format!("workload in {}", dir.display()),
    );
}

fn root_of(store: &Path, id: &str) -> String {
    let v = json(store, &["show", id]);
    v["root"]
        .as_str()
        .or(v["body"]["root"].as_str())
        .unwrap_or_else(|| panic!("no root in {v}"))
        .to_string()
}

#[test]
fn one_workload_gives_one_tree_in_both_backends_and_a_plain_directory() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("base");
    base(&src);
    let mut roots = Vec::new();
    // The overlay's lower as an EROFS image of the base (the default) and as the
    // tree's FUSE view (CASFS_OVERLAY_LOWER=view).
    for (mode, lower, read_mode) in [
        ("fuse", "image", "passthrough"),
        // A rootless overlay has no image: its lower is the view either way.
        (
            "overlay",
            "image",
            if crate::root() {
                "overlay-image"
            } else {
                "overlay"
            },
        ),
        ("overlay", "view", "overlay"),
    ] {
        let name = format!("{mode}-{lower}");
        let store = t.path().join(format!("store-{name}"));
        ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
        let mp = t.path().join(format!("mnt-{name}"));
        fs::create_dir(&mp).unwrap();
        let _g = MountGuard::new(&mp);
        let out = casfs_env(
            &store,
            &["mount", mp.to_str().unwrap(), "-t", "w", "--mode", mode],
            &[("CASFS_OVERLAY_LOWER", lower)],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        run_workload(&mp);
        let cp = json(&store, &["checkpoint", mp.to_str().unwrap()]);
        assert_eq!(cp["ok"], true, "{cp}");
        let id = cp["checkpoint"].as_str().unwrap().to_string();
        let st = json(&store, &["status", mp.to_str().unwrap()]);
        assert_eq!(st["dirty_files"], 0, "{name}: {st}");
        assert_eq!(st["mode"], mode);
        if mode == "overlay" || st["read_mode"] != "fuse" {
            assert_eq!(st["read_mode"], read_mode, "{name}: {st}");
        }
        // What the checkpoint holds is what the mount shows.
        let shown = snapshot(&mp);
        ok(&store, &["unmount", mp.to_str().unwrap()]);
        let out = t.path().join(format!("out-{name}"));
        ok(&store, &["restore", out.to_str().unwrap(), "--at", &id]);
        assert_eq!(snapshot(&out), shown, "{name}: restored vs mounted");
        roots.push((name, root_of(&store, &id)));
        ok(&store, &["fsck"]);
    }
    // The same changes made to a plain copy, captured.
    let plain = t.path().join("plain");
    fs::create_dir(&plain).unwrap();
    Command::new("cp")
        .args([
            "-a",
            &format!("{}/.", src.display()),
            plain.to_str().unwrap(),
        ])
        .status()
        .unwrap();
    run_workload(&plain);
    let store = t.path().join("store-plain");
    let c = json(&store, &["capture", plain.to_str().unwrap(), "-t", "p"]);
    let id = c["checkpoint"]["id"].as_str().unwrap().to_string();
    roots.push(("plain".into(), root_of(&store, &id)));
    assert!(
        roots.iter().all(|(_, r)| *r == roots[0].1),
        "root trees differ: {roots:?}"
    );
}

/// An overlay restore mounts a new generation in place: a process inside keeps the old
/// tree (its cwd and open files), new lookups see the restored one, the old layers go
/// once let go, and nothing of them is left under the store.
#[test]
fn an_overlay_restore_leaves_holders_on_the_old_tree() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    ok(
        &store,
        &[
            "mount",
            mp.to_str().unwrap(),
            "-t",
            "r",
            "--mode",
            "overlay",
        ],
    );
    fs::create_dir(mp.join("d")).unwrap();
    fs::write(mp.join("d/f"), "one").unwrap();
    // The mount's root is an overlay mount; a directory inside it is not.
    assert!(casfs::fs::is_overlay_mount(&mp));
    assert!(!casfs::fs::is_overlay_mount(&mp.join("d")));
    let first = json(&store, &["checkpoint", mp.to_str().unwrap()]);
    fs::write(mp.join("d/f"), "two").unwrap();
    fs::write(mp.join("d/g"), "new").unwrap();
    let second = json(&store, &["checkpoint", mp.to_str().unwrap()])["checkpoint"]
        .as_str()
        .unwrap()
        .to_string();
    let held = fs::File::open(mp.join("d/f")).unwrap();
    let cwd = fs::File::open(mp.join("d")).unwrap();
    let r = json(
        &store,
        &[
            "restore",
            mp.to_str().unwrap(),
            first["checkpoint"].as_str().unwrap(),
        ],
    );
    assert!(r["duration_us"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(fs::read_to_string(mp.join("d/f")).unwrap(), "one");
    assert!(!mp.join("d/g").exists());
    // The holder still reads the old file and lists the old directory.
    let mut s = String::new();
    use std::io::Read;
    (&held).read_to_string(&mut s).unwrap();
    assert_eq!(s, "two");
    let old: Vec<_> = fs::read_dir(format!("/proc/self/fd/{}", {
        use std::os::fd::AsRawFd;
        cwd.as_raw_fd()
    }))
    .unwrap()
    .map(|e| e.unwrap().file_name())
    .collect();
    assert_eq!(old.len(), 2, "{old:?}");
    drop((held, cwd));
    // One generation is left under the store (the old one is removed in the background).
    let key_dir = fs::read_dir(store.join("mounts"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(crate::wait_for(std::time::Duration::from_secs(10), || {
        fs::read_dir(key_dir.join("overlay")).unwrap().count() == 1
    }));
    let st = json(&store, &["status", mp.to_str().unwrap()]);
    assert_eq!(
        (st["dirty_files"].as_u64(), st["mode"].as_str()),
        (Some(0), Some("overlay"))
    );
    // A generation replaced right before the unmount (its teardown still waiting for a
    // quiet store) is torn down by the unmount, not left behind by the exiting daemon.
    let held = fs::File::open(mp.join("d/f")).unwrap();
    ok(&store, &["restore", mp.to_str().unwrap(), &second]);
    assert_eq!(fs::read_to_string(mp.join("d/g")).unwrap(), "new");
    drop(held);
    ok(&store, &["unmount", mp.to_str().unwrap()]);
    assert!(!casfs::fs::is_overlay_mount(&mp));
    assert!(crate::wait_for(std::time::Duration::from_secs(10), || {
        fs::read_dir(key_dir.join("overlay")).unwrap().count() == 1
    }));
    // No mount of it is left anywhere (the lower views included).
    assert!(crate::wait_for(std::time::Duration::from_secs(10), || {
        crate::mounts_under(t.path()).is_empty()
    }));
}

/// Uncaptured work of one backend is never dropped by the other: mounting with the
/// other mode is refused until it is checkpointed, and then starts at that checkpoint.
#[test]
fn switching_backends_keeps_uncaptured_work() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    let m = mp.to_str().unwrap();
    let mount = |mode: &str| casfs(&store, &["mount", m, "-t", "sw", "--mode", mode]);
    let unmount = || {
        ok(&store, &["unmount", m]);
        assert!(crate::wait_for(std::time::Duration::from_secs(10), || {
            !fs::read_dir(store.join("mounts"))
                .unwrap()
                .flatten()
                .any(|d| d.path().join("pid").exists())
        }));
    };
    for (from, to) in [("overlay", "fuse"), ("fuse", "overlay")] {
        assert!(mount(from).status.success());
        fs::write(mp.join(format!("by-{from}")), from).unwrap();
        unmount();
        let out = mount(to);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{from} -> {to}: {err}");
        assert!(err.contains("uncaptured"), "{err}");
        assert!(mount(from).status.success());
        assert_eq!(
            fs::read_to_string(mp.join(format!("by-{from}"))).unwrap(),
            from
        );
        ok(&store, &["checkpoint", m]);
        unmount();
        assert!(
            mount(to).status.success(),
            "{from} -> {to} after a checkpoint"
        );
        let st = json(&store, &["status", m]);
        assert_eq!(
            (st["mode"].as_str(), st["dirty_files"].as_u64()),
            (Some(to), Some(0))
        );
        assert_eq!(
            fs::read_to_string(mp.join(format!("by-{from}"))).unwrap(),
            from
        );
        unmount();
    }
    ok(&store, &["fsck"]);
}

/// The overlay's image of a tree is checked by fsck byte for byte: one byte flipped in a
/// file's redirect (which would serve another content) is an error naming the image,
/// `--repair` removes it, and the next mount rebuilds it and reads the right bytes.
#[test]
fn fsck_finds_a_damaged_image_and_the_next_mount_rebuilds_it() {
    if crate::needs_root("a rootless overlay has no image") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("base");
    base(&src);
    let store = t.path().join("s");
    ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    let mount = || {
        ok(
            &store,
            &[
                "mount",
                mp.to_str().unwrap(),
                "-t",
                "w",
                "--mode",
                "overlay",
            ],
        )
    };
    mount();
    assert_eq!(
        json(&store, &["status", mp.to_str().unwrap()])["read_mode"],
        "overlay-image"
    );
    ok(&store, &["unmount", mp.to_str().unwrap()]);
    ok(&store, &["fsck"]);
    let images: Vec<_> = fs::read_dir(store.join("images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "erofs"))
        .collect();
    assert_eq!(images.len(), 1, "{images:?}");
    let image = &images[0];
    let mut bytes = fs::read(image).unwrap();
    let at = bytes
        .windows(b"overlay.redirect".len())
        .position(|w| w == b"overlay.redirect")
        .expect("a redirect in the image")
        + b"overlay.redirect".len()
        + 5;
    bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
    fs::write(image, &bytes).unwrap();
    let out = casfs(&store, &["fsck"]);
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("the image differs from its tree"), "{said}");
    let name = image.file_name().unwrap().to_string_lossy().into_owned();
    assert!(said.contains(&name), "{said}");
    let _ = casfs(&store, &["fsck", "--repair"]);
    assert!(!image.exists(), "the damaged image is removed");
    ok(&store, &["fsck"]);
    mount();
    assert!(image.exists(), "the next mount rebuilds it");
    assert_eq!(
        json(&store, &["status", mp.to_str().unwrap()])["read_mode"],
        "overlay-image"
    );
    assert_eq!(snapshot(&mp), snapshot(&src));
    ok(&store, &["unmount", mp.to_str().unwrap()]);
    ok(&store, &["fsck"]);
}

/// The kernel hands an unmounted overlay's anonymous device number to the next mount at
/// once, so a daemon that knew its overlay by `st_dev` took the next sandbox's overlay
/// at the same path for its own (and never exited; CI saw it). The mount's identity
/// tells the two apart.
#[test]
fn an_overlay_mounted_after_another_at_its_path_is_told_apart() {
    let t = tempfile::tempdir().unwrap();
    let d = |n: &str| {
        let p = t.path().join(n);
        fs::create_dir(&p).unwrap();
        p
    };
    let (lower, mp) = (d("lower"), d("mnt"));
    let _guard = MountGuard::new(&mp);
    let mut seen = Vec::new();
    for i in 0..3 {
        let (upper, work) = (d(&format!("upper{i}")), d(&format!("work{i}")));
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        run_ok(
            Command::new("mount")
                .args(["-t", "overlay", "overlay", "-o", &opts])
                .arg(&mp),
            "mount -t overlay",
        );
        let id = casfs::fs::mount_identity(&mp);
        assert_ne!(id, (0, 0));
        assert!(
            !seen.contains(&id),
            "round {i}: {id:?} seen before: {seen:?}"
        );
        seen.push(id);
        assert!(Command::new("umount").arg(&mp).status().unwrap().success());
    }
}

/// Changes made one step at a time, a checkpoint after each: an overlay checkpoint
/// visits only the directories its upper's watch saw change (and those above them) and
/// takes the rest from the checkpoint before, so every step is compared with a plain
/// copy of the mount captured whole. The steps aim at what a watch can get wrong: deep
/// changes, directories renamed (upper and lower ones) and moved back, replaced by
/// files and the reverse, attribute-only changes of directories, names that are not
/// UTF-8 and differ only there, a remount and a restore in the middle. The FUSE backend
/// runs the same steps.
#[test]
fn every_checkpoint_of_a_series_is_the_tree_a_full_capture_gives() {
    const STEPS: &[&str] = &[
        "mkdir -p n1/n2/n3 && echo a > n1/n2/n3/f && echo b > n1/f",
        "echo more >> n1/n2/n3/f",
        "mv n1/n2 n1/m2",
        "mv keep kept && echo k >> kept/sub/y",
        "rm -rf n1/m2/n3 && mkdir n1/m2/n3 && echo new > n1/m2/n3/g",
        "chmod 700 n1/m2 && touch -d @1000 n1/m2 && python3 -c \"import os; os.setxattr('n1', 'user.d', b'1')\"",
        "mkdir \"$(printf 'd\\377')\" \"$(printf 'd\\376')\" && echo 1 > \"$(printf 'd\\377')/f\" && echo 2 > \"$(printf 'd\\376')/f\"",
        "REMOUNT",
        "echo 3 >> \"$(printf 'd\\376')/f\"",
        "mv n1 gone/n1 && echo g >> gone/n1/f",
        "mv gone/n1 n1back",
        "rm -rf gone",
        "rm a.txt && mkdir a.txt && echo x > a.txt/in && rm -rf replace_dir && echo f > replace_dir",
        "ln kept/x hl && echo z >> hl",
        "true",
        "RESTORE 3",
        "echo after > kept/sub/after && mkdir -p deep/er && echo d > deep/er/f",
        "mkdir -p wide && for i in $(seq 1 300); do echo $i > wide/f$i; done",
        "echo one >> wide/f7",
        "mkdir t1 && mv wide t1/ && mv t1 t2",
    ];
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("base");
    base(&src);
    for mode in ["overlay", "fuse"] {
        let store = t.path().join(format!("store-{mode}"));
        ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
        let mp = t.path().join(format!("mnt-{mode}"));
        fs::create_dir(&mp).unwrap();
        let _g = MountGuard::new(&mp);
        let m = mp.to_str().unwrap();
        ok(&store, &["mount", m, "-t", "w", "--mode", mode]);
        let mut ids = Vec::new();
        for (i, step) in STEPS.iter().enumerate() {
            if *step == "REMOUNT" {
                ok(&store, &["unmount", m]);
                ok(&store, &["mount", m, "-t", "w", "--mode", mode]);
                continue;
            }
            if let Some(n) = step.strip_prefix("RESTORE ") {
                let id: &String = &ids[n.parse::<usize>().unwrap()];
                ok(&store, &["restore", m, id, "--force"]);
                continue;
            }
            run_ok(
                Command::new("sh").arg("-c").arg(step).current_dir(&mp),
                &format!("{mode} step {i} `{step}`"),
            );
            let st = json(&store, &["status", m]);
            if *step != "true" {
                assert!(
                    st["dirty_nodes"].as_u64().unwrap() > 0,
                    "{mode} step {i}: {st}"
                );
            }
            let cp = json(&store, &["checkpoint", m]);
            assert_eq!(cp["ok"], true, "{cp}");
            let id = cp["checkpoint"].as_str().unwrap().to_string();
            let st = json(&store, &["status", m]);
            assert_eq!(st["dirty_nodes"], 0, "{mode} step {i} `{step}`: {st}");

            // The oracle: a plain copy of what the mount shows, captured whole.
            let plain = t.path().join(format!("plain-{mode}-{i}"));
            run_ok(
                Command::new("cp")
                    .arg("-a")
                    .arg(format!("{m}/."))
                    .arg(&plain),
                "cp -a",
            );
            let ps = t.path().join(format!("store-plain-{mode}-{i}"));
            let c = json(&ps, &["capture", plain.to_str().unwrap(), "-t", "p"]);
            let want = root_of(&ps, c["checkpoint"]["id"].as_str().unwrap());
            assert_eq!(
                root_of(&store, &id),
                want,
                "{mode} step {i} `{step}`: the checkpoint is not what the mount shows"
            );
            fs::remove_dir_all(&plain).unwrap();
            fs::remove_dir_all(&ps).unwrap();
            ids.push(id);
        }
        ok(&store, &["unmount", m]);
        ok(&store, &["fsck"]);
    }
}
