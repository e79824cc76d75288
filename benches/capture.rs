//! Capture benchmark: casfs against its peers on generated source-like trees.
//!
//! For each tree size it measures, as wall time of the real commands in one run:
//! - initial capture: `casfs capture` (fresh store) vs `tar -c | zstd -T0 -3` vs
//!   `git add -A && git commit` (fresh repo) vs `restic backup` (fresh repo),
//! - re-capture after 10 changed files: `casfs capture` vs `git add -A && git commit`
//!   vs `restic backup` (incremental).
//!
//! Every figure is the median of `--reps` runs; ratios are peer / casfs of the medians.
//! The tools take turns within a round, in an order that rotates between rounds, and a
//! `sync` (untimed) comes before every timed step.
//! Peers that are not installed are skipped with a note. `--out FILE` writes every run
//! as a result file (docs/results/README.md); `CASFS_BENCH_DIR` is where the trees go.
//!
//! Run: `cargo bench --bench capture -- [--sizes 1000,10000,100000] [--reps 3] [--out F]`

use std::fs;
use std::path::PathBuf;

use std::time::Duration;

#[path = "common/mod.rs"]
mod common;
use common::*;

struct Row {
    tool: &'static str,
    scenario: &'static str,
    size: usize,
    median: Duration,
}

fn main() {
    let args = parse_bench_args(3);
    let mut res = Results::cargo_bench("capture");
    res.param("sizes", &args.sizes);
    res.param("reps", args.reps);
    let casfs = env!("CARGO_BIN_EXE_casfs");
    let (git, tar_zstd, restic) = (have("git"), have("tar") && have("zstd"), have("restic"));
    for (ok, name) in [(git, "git"), (tar_zstd, "tar+zstd"), (restic, "restic")] {
        if !ok {
            println!("note: {name} is not installed; skipped");
            res.note(format!("{name} is not installed; skipped"));
        }
    }
    let base = std::env::var_os("CASFS_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    res.bench_dir(&base);
    let mut rows = Vec::new();
    for &n in &args.sizes {
        let tmp = tempfile::tempdir_in(&base).unwrap();
        let tree = tmp.path().join("tree");
        let (files, bytes) = generate(&tree, n);
        res.value(
            serde_json::json!({"scenario": "workload", "tool": "generated", "files": n}),
            "B",
            bytes as f64,
        );
        println!(
            "\n{n} files, {:.1} MB (median of {} runs)",
            bytes as f64 / 1e6,
            args.reps
        );
        // Let the clock pass the files' timestamps (see the directory cache's racy rule).
        std::thread::sleep(Duration::from_millis(200));
        let tree_s = tree.to_str().unwrap();
        let out = tmp.path().join("out");
        let out_s = out.to_str().unwrap();
        let mut add = |tool, scenario, v: Vec<Duration>| {
            let labels = serde_json::json!({"scenario": scenario, "tool": tool, "files": n});
            let m = res.times(labels, &v);
            println!("  {scenario:<28} {tool:<10} {:>9.3} s", m.as_secs_f64());
            rows.push(Row {
                tool,
                scenario,
                size: n,
                median: m,
            });
        };

        // Initial capture, each run into a fresh store / repo, the tools in turn: the
        // order rotates every round and a `sync` (untimed) comes before each step, so
        // no tool pays for another's writeback or its own set-up's.
        let mut tools = vec!["casfs"];
        if tar_zstd {
            tools.push("tar+zstd");
        }
        if restic {
            tools.push("restic");
        }
        if git {
            tools.push("git");
        }
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); tools.len()];
        for rep in 0..args.reps {
            for k in 0..tools.len() {
                let i = (k + rep) % tools.len();
                let _ = fs::remove_dir_all(&out);
                let t = match tools[i] {
                    "casfs" => {
                        sh("sync", &[]);
                        sh(
                            &format!("{casfs} --store {out_s} capture {tree_s} -t b"),
                            &[],
                        )
                    }
                    "tar+zstd" => {
                        fs::create_dir_all(&out).unwrap();
                        sh("sync", &[]);
                        sh(
                            &format!(
                                "tar -cf - -C {tree_s} . | zstd -T0 -3 -q -o {out_s}/t.tar.zst"
                            ),
                            &[],
                        )
                    }
                    "restic" => {
                        sh(&format!("restic init -q -r {out_s}"), GIT_ENV);
                        sh("sync", &[]);
                        sh(
                            &format!("cd {tree_s} && restic backup -q -r {out_s} ."),
                            GIT_ENV,
                        )
                    }
                    _ => {
                        // The repository lives outside the tree, so no tool ever sees
                        // another's files.
                        let env = git_env(&out, &tree);
                        sh("git init -q && git config gc.auto 0", &env);
                        sh("sync", &[]);
                        sh("git add -A && git commit -q -m initial", &env)
                    }
                };
                times[i].push(t);
            }
        }
        for (tool, t) in tools.iter().zip(times) {
            add(tool, "initial capture", t);
        }

        // Fresh stores that hold the tree, then re-captures after 10 changes each.
        let _ = fs::remove_dir_all(&out);
        let store = tmp.path().join("store");
        let store_s = store.to_str().unwrap();
        let restic_repo = tmp.path().join("restic");
        let restic_s = restic_repo.to_str().unwrap();
        sh(
            &format!("{casfs} --store {store_s} capture {tree_s} -t b"),
            &[],
        );
        let git_dir = tmp.path().join("git");
        let genv = git_env(&git_dir, &tree);
        if git {
            sh("git init -q && git config gc.auto 0", &genv);
            sh("git add -A && git commit -q -m initial", &genv);
        }
        if restic {
            sh(&format!("restic init -q -r {restic_s}"), GIT_ENV);
            sh(
                &format!("cd {tree_s} && restic backup -q -r {restic_s} ."),
                GIT_ENV,
            );
        }
        let (mut tc, mut tg, mut tr) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..args.reps {
            for k in 0..10 {
                let f = &files[(k * 7919 + rep * 104_729) % files.len()];
                let mut data = fs::read(f).unwrap();
                data.extend_from_slice(format!("\n// change {rep} {k}\n").as_bytes());
                fs::write(f, data).unwrap();
            }
            // The same changes for every tool; the order rotates, a sync before each.
            for k in 0..3 {
                sh("sync", &[]);
                match (k + rep) % 3 {
                    0 => tc.push(sh(
                        &format!("{casfs} --store {store_s} capture {tree_s} -t b"),
                        &[],
                    )),
                    1 if git => tg.push(sh("git add -A && git commit -q -m change", &genv)),
                    2 if restic => tr.push(sh(
                        &format!("cd {tree_s} && restic backup -q -r {restic_s} ."),
                        GIT_ENV,
                    )),
                    _ => {}
                }
            }
        }
        add("casfs", "re-capture after 10 changes", tc);
        if git {
            add("git", "re-capture after 10 changes", tg);
        }
        if restic {
            add("restic", "re-capture after 10 changes", tr);
        }
        let mb = bytes as f64 / 1e6;
        let c = rows
            .iter()
            .find(|r| r.size == n && r.tool == "casfs" && r.scenario == "initial capture")
            .unwrap()
            .median
            .as_secs_f64();
        println!(
            "  casfs initial capture: {:.0} MB/s, {:.0} files/s",
            mb / c,
            n as f64 / c
        );
    }

    println!("\nratios (peer median / casfs median; above 1 means casfs is faster)");
    for r in &rows {
        if r.tool == "casfs" {
            continue;
        }
        let c = rows
            .iter()
            .find(|x| x.tool == "casfs" && x.scenario == r.scenario && x.size == r.size)
            .unwrap();
        println!(
            "  {:>7} files  {:<28} {:<10} {:>6.2}x",
            r.size,
            r.scenario,
            r.tool,
            r.median.as_secs_f64() / c.median.as_secs_f64()
        );
    }
    res.finish();
}
