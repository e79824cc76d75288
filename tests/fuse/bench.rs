//! `casfs bench`: every scenario and every peer runs on a tiny workload and the JSON
//! report is well formed, a result file as docs/results/README.md describes (its
//! figures are not judged here: benchmarks are not tests).

use std::process::Command;

use crate::common::casfs_bin;

#[test]
fn every_scenario_and_peer_runs_and_reports_json() {
    if crate::needs_root("restic restores the owners of what it saved, root among them") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("report.json");
    let plot = t.path().join("plot.svg");
    let o = Command::new(casfs_bin())
        .args([
            "--json", "bench", "--sizes", "60,120", "--reps", "1", "--runs", "2",
        ])
        .args([
            "--io-mb",
            "4",
            "--depth",
            "2",
            "--files-per-dir",
            "7",
            "--median-size",
            "500",
        ])
        .arg("--out")
        .arg(&out)
        .arg("--plot")
        .arg(&plot)
        .arg("--keep")
        .arg(t.path().join("work"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json prints JSON");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(printed, written);
    let r = &written;
    // Who ran what, where and when.
    assert_eq!(r["format"], "casfs-bench-result/1");
    assert_eq!(r["bench"], "casfs bench");
    let command = r["command"].as_str().unwrap();
    assert!(
        command.starts_with("casfs --json bench --sizes 60,120"),
        "{command}"
    );
    // The commit of this source tree (none outside a git checkout).
    let git = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".git")
        .exists();
    let commit = r["commit"].as_str().map(str::len);
    assert_eq!(commit, git.then_some(40), "{}", r["commit"]);
    assert!(r["date"].as_str().unwrap().ends_with('Z'));
    let m = &r["machine"];
    assert!(m["cores"].as_u64().unwrap() >= 1 && m["memory_bytes"].as_u64().unwrap() > 0);
    assert!(!m["kernel"].as_str().unwrap().is_empty());
    assert!(m["bench_dir"].as_str().unwrap().ends_with("/work"), "{m}");
    assert!(!m["filesystem"]["type"].as_str().unwrap().is_empty(), "{m}");
    assert_eq!(r["workloads"].as_array().unwrap().len(), 2);
    assert_eq!(r["workloads"][0]["shape"], serde_json::json!([2, 7, 500]));
    let results = r["rows"].as_array().unwrap();
    let skipped = r["skipped"].as_array().unwrap();
    for sc in ["capture", "recapture", "restore", "loop"] {
        for tool in ["casfs", "git", "restic", "tar+zstd", "rsync"] {
            let ran = results.iter().any(|s| {
                s["scenario"] == sc && s["tool"] == tool && s["median"].as_f64().unwrap() > 0.0
            });
            let noted = skipped.iter().any(|s| s["tool"] == tool);
            assert!(
                ran || noted,
                "{sc}/{tool}: neither measured nor skipped with a note"
            );
        }
    }
    for tool in ["casfs", "ext4", "fuse-overlayfs"] {
        for op in ["write 4 MiB", "read 4 MiB", "untar", "find", "git status"] {
            assert!(
                results
                    .iter()
                    .any(|s| s["scenario"] == "io" && s["tool"] == tool && s["op"] == op)
                    || skipped.iter().any(|s| s["tool"] == tool),
                "io {op} {tool}"
            );
        }
    }
    for s in results {
        let runs = s["runs"].as_array().unwrap();
        assert!(
            !runs.is_empty() && runs.iter().all(|x| x.as_f64().unwrap() >= 0.0),
            "{s}"
        );
        assert_eq!(s["unit"], "ms");
        assert!(s["files"].as_u64().unwrap() > 0);
    }
    // Ratios pair casfs with each peer; slopes exist for the two sizes.
    let ratios = r["ratios"].as_array().unwrap();
    assert!(ratios
        .iter()
        .any(|x| x["scenario"] == "capture" && x["peer"] == "git"));
    assert!(ratios.iter().all(|x| x["ratio"].as_f64().unwrap() > 0.0));
    assert!(r["slopes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["tool"] == "casfs"));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("casfs"),
        "an SVG plot naming casfs"
    );
    // --compare reads two reports.
    let c = Command::new(casfs_bin())
        .args(["bench", "--compare"])
        .arg(&out)
        .arg(&out)
        .output()
        .unwrap();
    assert!(c.status.success());
    assert!(String::from_utf8_lossy(&c.stdout).contains("+0.0%"));
    // And a report from before result files (`results`, `median_ms`, `runs_ms`, no run).
    let mut old = written.clone();
    let o = old.as_object_mut().unwrap();
    for k in [
        "format",
        "bench",
        "command",
        "commit",
        "commit_dirty",
        "date",
        "profile",
        "env",
    ] {
        o.remove(k);
    }
    let mut rows = o.remove("rows").unwrap();
    for row in rows.as_array_mut().unwrap() {
        let row = row.as_object_mut().unwrap();
        row.remove("unit");
        let m = row.remove("median").unwrap();
        row.insert("median_ms".into(), m);
        let runs = row.remove("runs").unwrap();
        row.insert("runs_ms".into(), runs);
    }
    o.insert("results".into(), rows);
    let old_path = t.path().join("old.json");
    std::fs::write(&old_path, serde_json::to_string(&old).unwrap()).unwrap();
    let c = Command::new(casfs_bin())
        .args(["bench", "--compare"])
        .arg(&old_path)
        .arg(&out)
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    assert!(String::from_utf8_lossy(&c.stdout).contains("+0.0%"));
    // No mount is left behind.
    assert!(!std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .contains(&t.path().to_string_lossy().to_string()));
}
