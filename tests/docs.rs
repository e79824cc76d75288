//! The docs hold what the code and the result files say: every table between
//! `<!-- results:NAME -->` markers is what `scripts/render-results.py` renders from the
//! result files under docs/results/ (and the renderer itself works, on the fixture under
//! tests/fixtures/results/), every relative link and image of README.md and docs/
//! resolves inside the repository, and docs/architecture.md's code map names every
//! module under src/.

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the renderer (with `args`) on the tree at `dir`.
fn render(dir: &Path, args: &[&str]) -> Output {
    Command::new("python3")
        .arg(root().join("scripts/render-results.py"))
        .arg("--root")
        .arg(dir)
        .args(args)
        .output()
        .expect("python3 runs scripts/render-results.py")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn tables_in_the_docs_are_what_the_result_files_give() {
    let o = render(root(), &["--check"]);
    assert!(
        o.status.success(),
        "a table of README.md or docs/ is not what docs/results/ gives (run \
         scripts/render-results.py):\n{}",
        text(&o)
    );
}

/// A copy of directory `from` at `to`.
fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &p);
        } else {
            fs::copy(e.path(), &p).unwrap();
        }
    }
}

fn only_file(dir: &Path) -> PathBuf {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files.pop().unwrap()
}

#[test]
fn the_renderer_finds_a_stale_table_and_shows_the_newest_run() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tree");
    copy_tree(&root().join("tests/fixtures/results"), &dir);
    let doc = dir.join("docs/bench.md");
    let rendered = fs::read_to_string(&doc).unwrap();
    let o = render(&dir, &["--check"]);
    assert!(o.status.success(), "the fixture is rendered: {}", text(&o));

    // A figure typed over by hand is found, and rendering puts it back.
    let file = only_file(&dir.join("docs/results/capture"));
    let run: serde_json::Value = serde_json::from_str(&fs::read_to_string(&file).unwrap()).unwrap();
    let casfs = run["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["scenario"] == "initial capture" && r["tool"] == "casfs")
        .unwrap()["median"]
        .as_f64()
        .unwrap();
    let shown = format!("| {casfs:.1} |");
    assert!(rendered.contains(&shown), "{shown} in {rendered}");
    fs::write(&doc, rendered.replacen(&shown, "| 1.0 |", 1)).unwrap();
    let o = render(&dir, &["--check"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("docs/bench.md"), "{}", text(&o));
    assert!(
        fs::read_to_string(&doc).unwrap().contains("| 1.0 |"),
        "--check changes nothing"
    );
    let o = render(&dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(fs::read_to_string(&doc).unwrap(), rendered);

    // A newer run: the tables show it, and say where the earlier one is.
    let mut newer = run.clone();
    newer["date"] = "2999-01-01T00:00:00Z".into();
    for r in newer["rows"].as_array_mut().unwrap() {
        if r["scenario"] == "initial capture" && r["tool"] == "casfs" {
            r["runs"] = serde_json::json!([4321.0, 1234.5, 2000.0]);
            r["median"] = 2000.0.into();
        }
    }
    let newer_name = "2999-01-01T00-00-00Z-0000000.json";
    let newer_path = dir.join("docs/results/capture").join(newer_name);
    fs::write(&newer_path, serde_json::to_string_pretty(&newer).unwrap()).unwrap();
    let o = render(&dir, &["--check"]);
    assert!(!o.status.success(), "a newer run makes the tables stale");
    let o = render(&dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let now = fs::read_to_string(&doc).unwrap();
    assert!(now.contains("| 2,000.0 |"), "{now}");
    let old_name = file.file_name().unwrap().to_str().unwrap();
    // The line under a table is wrapped: compare its words.
    let words = now.split_whitespace().collect::<Vec<_>>().join(" ");
    let from = words.find(&format!("From [`{newer_name}`]"));
    let earlier = words.find(&format!("Earlier runs: [`{old_name}`]"));
    assert!(from.is_some() && earlier > from, "{now}");
    let readme = fs::read_to_string(dir.join("README.md")).unwrap();
    assert!(readme.contains("| 2,000 ms |"), "{readme}");

    // A result file whose median is not its runs' is refused, naming it.
    newer["rows"][1]["median"] = 1.0.into();
    fs::write(&newer_path, serde_json::to_string_pretty(&newer).unwrap()).unwrap();
    let o = render(&dir, &["--check"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains(newer_name) && text(&o).contains("median"),
        "{}",
        text(&o)
    );
}

/// The link targets of Markdown `text` (inline links and images, reference
/// definitions, HTML `src=` and `href=`), outside code spans and fenced blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans dropped.
        let mut plain = String::new();
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                plain.push(c);
            }
        }
        if let Some(def) = plain.trim_start().strip_prefix('[') {
            if let Some((_, target)) = def.split_once("]:") {
                out.push(target.split_whitespace().next().unwrap_or("").to_string());
            }
        }
        let b = plain.as_bytes();
        let mut i = 0;
        while i + 1 < b.len() {
            if b[i] == b']' && b[i + 1] == b'(' {
                let rest = &plain[i + 2..];
                if let Some(end) = rest.find(')') {
                    let target = rest[..end].split_whitespace().next().unwrap_or("");
                    out.push(target.trim_matches(['<', '>']).to_string());
                }
            }
            i += 1;
        }
        for attr in ["src=\"", "href=\""] {
            for (at, _) in plain.match_indices(attr) {
                let rest = &plain[at + attr.len()..];
                if let Some(end) = rest.find('"') {
                    out.push(rest[..end].to_string());
                }
            }
        }
    }
    out
}

/// `p` with `.` and `..` resolved lexically (none may climb above the start).
fn normalize(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

#[test]
fn relative_links_and_images_resolve_inside_the_repository() {
    let mut docs = vec![root().join("README.md")];
    let mut stack = vec![root().join("docs")];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                docs.push(p);
            }
        }
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let rel_doc = doc.strip_prefix(root()).unwrap();
        for target in link_targets(&fs::read_to_string(doc).unwrap()) {
            if target.is_empty()
                || target.starts_with('#')
                || target.contains("://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let path = target.split('#').next().unwrap();
            let joined = rel_doc.parent().unwrap().join(path);
            checked += 1;
            match normalize(&joined) {
                Some(p) if root().join(&p).exists() => {}
                Some(p) => broken.push(format!(
                    "{}: {target} ({} does not exist)",
                    rel_doc.display(),
                    p.display()
                )),
                None => broken.push(format!(
                    "{}: {target} (outside the repository)",
                    rel_doc.display()
                )),
            }
        }
    }
    assert!(checked > 20, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_code_map_names_every_module() {
    let map = fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let mut missing = Vec::new();
    let mut stack = vec![root().join("src")];
    let mut n = 0;
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                n += 1;
                let rel = p.strip_prefix(root().join("src")).unwrap();
                let name = format!("`{}`", rel.display());
                if !map.contains(&name) {
                    missing.push(name);
                }
            }
        }
    }
    missing.sort();
    assert!(n > 50, "{n} modules");
    assert!(
        missing.is_empty(),
        "docs/architecture.md's code map does not name {} module(s) (as `path/under/src.rs`): {}",
        missing.len(),
        missing.join(", ")
    );
}

/// The `.rs` files under `dir`, with their lines that are code (comment lines dropped).
fn code_lines_under(dir: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let lines = fs::read_to_string(&p)
                    .unwrap()
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .map(str::to_string)
                    .collect();
                out.push((p, lines));
            }
        }
    }
    out
}

/// Whether `line` names module `m` (`crate::m`, then `::`, `;`, `,`, `}` or a space).
fn uses(line: &str, m: &str) -> bool {
    let pat = format!("crate::{m}");
    line.match_indices(&pat).any(|(i, _)| {
        !line[i + pat.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn every_folder_says_what_it_may_not_use_and_keeps_to_it() {
    let map = fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let src = root().join("src");
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    for line in map.lines() {
        let Some(rest) = line.strip_prefix("- `") else {
            continue;
        };
        let Some((folder, rest)) = rest.split_once("/`: ") else {
            continue;
        };
        let Some((_, banned)) = rest.split_once("may not use: ") else {
            continue;
        };
        let names = banned
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        rules.push((folder.to_string(), names));
    }
    let mut problems = Vec::new();
    let mut stack = vec![src.clone()];
    let mut folders = 0;
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                folders += 1;
                let rel = p.strip_prefix(&src).unwrap().display().to_string();
                if !rules.iter().any(|(f, _)| *f == rel) {
                    problems.push(format!("no line for `{rel}/`"));
                }
                stack.push(p);
            }
        }
    }
    assert!(folders > 15, "{folders} folders");
    for (folder, banned) in &rules {
        let dir = src.join(folder);
        if !dir.is_dir() {
            problems.push(format!("`{folder}/` is not a folder of src/"));
            continue;
        }
        let top = folder.split('/').next().unwrap();
        if banned.is_empty() {
            // Nothing below may use this folder's module instead.
            for (file, lines) in code_lines_under(&src) {
                if !file.starts_with(&dir) && lines.iter().any(|l| uses(l, top)) {
                    problems.push(format!("{} uses `{top}`", file.display()));
                }
            }
            continue;
        }
        for (file, lines) in code_lines_under(&dir) {
            for m in banned {
                if let Some(l) = lines.iter().find(|l| uses(l, m)) {
                    problems.push(format!(
                        "{} uses `{m}`, which `{folder}/` may not: {}",
                        file.display(),
                        l.trim()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_table_shows_the_newest_run_of_its_own_settings() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tree");
    copy_tree(&root().join("tests/fixtures/results"), &dir);
    let doc = dir.join("docs/bench.md");
    let rendered = fs::read_to_string(&doc).unwrap();
    // A newer run of the same benchmark with other settings.
    let file = only_file(&dir.join("docs/results/capture"));
    let mut other: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&file).unwrap()).unwrap();
    other["date"] = "2999-01-01T00:00:00Z".into();
    other["command"] = "cargo bench --bench capture -- --mode overlay".into();
    for r in other["rows"].as_array_mut().unwrap() {
        r["runs"] = serde_json::json!([7777.0]);
        r["median"] = 7777.0.into();
    }
    let other_name = "2999-01-01T00-00-00Z-0000000.json";
    fs::write(
        dir.join("docs/results/capture").join(other_name),
        serde_json::to_string_pretty(&other).unwrap(),
    )
    .unwrap();
    // Tables that leave those settings out show the run they showed, and do not
    // name the other as an earlier run.
    let tables_path = dir.join("docs/results/tables.json");
    let mut tables: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&tables_path).unwrap()).unwrap();
    for name in ["capture-initial", "capture-seconds"] {
        tables[name]["command_lacks"] = "--mode overlay".into();
    }
    fs::write(&tables_path, tables.to_string()).unwrap();
    let o = render(&dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let now = fs::read_to_string(&doc).unwrap();
    let table = |s: &str| {
        s.split("<!-- /results:capture-seconds -->")
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        table(&now),
        table(&rendered),
        "the table of the other settings is unchanged"
    );
    assert!(!table(&now).contains(other_name), "{now}");
    // A table that asks for them shows the other run.
    for name in ["capture-initial", "capture-seconds"] {
        tables[name]
            .as_object_mut()
            .unwrap()
            .remove("command_lacks");
        tables[name]["command_has"] = serde_json::json!(["--mode", "overlay"]);
    }
    fs::write(&tables_path, tables.to_string()).unwrap();
    let o = render(&dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(fs::read_to_string(&doc).unwrap().contains("| 7,777.0 |"));
    // None matching: an error that names what was asked.
    tables["capture-initial"]["command_has"] = "--no-such-flag".into();
    fs::write(&tables_path, tables.to_string()).unwrap();
    let o = render(&dir, &["--check"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--no-such-flag"), "{}", text(&o));
}

/// The measured figures of `line`: a number followed by a time unit finer than a second
/// (`12 ms`, `30 us`), a rate (`690 runs/s`, `95 MB/s`) or a ratio (`1.4x`).
fn figures_in(line: &str) -> Vec<String> {
    const TIMES: [&str; 3] = ["ms", "us", "µs"];
    const RATES: [&str; 6] = ["runs/s", "MB/s", "GB/s", "MiB/s", "GiB/s", "files/s"];
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut out = Vec::new();
    let mut i = 0;
    while i < line.len() {
        let c = line[i..].chars().next().unwrap();
        if !c.is_ascii_digit() || word(line[..i].chars().next_back()) {
            i += c.len_utf8();
            continue;
        }
        let len = line[i..]
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','))
            .unwrap_or(line.len() - i);
        let number = line[i..i + len].trim_end_matches(['.', ',']);
        let after = &line[i + number.len()..];
        let unit = if let Some(rest) = after.strip_prefix('x') {
            (!word(rest.chars().next())).then_some("x")
        } else {
            let spaced = after.strip_prefix(' ').unwrap_or(after);
            TIMES
                .iter()
                .chain(RATES.iter())
                .find(|u| spaced.starts_with(**u) && !word(spaced[u.len()..].chars().next()))
                .copied()
        };
        if let Some(u) = unit {
            out.push(format!("{number} {u}"));
        }
        i += len.max(1);
    }
    out
}

#[test]
fn figures_in_finds_times_rates_and_ratios_only() {
    assert_eq!(
        figures_in("took 12.5 ms, 1,020 runs/s and 1.4x native; 30us"),
        ["12.5 ms", "1,020 runs/s", "1.4 x", "30 us"]
    );
    assert!(figures_in("0x1f, 4 KiB, 30 s, v2 msg, 3 xattrs, 1 MiB chunks, 2 user").is_empty());
}

/// Numbers with a unit that are settings or constants, not measurements: the doc, and
/// the text around the number.
const NOT_MEASURED: &[(&str, &str)] = &[
    ("docs/checkpoints.md", "more than 100 ms"),
    ("docs/checkpoints.md", "every 15 ms"),
    ("docs/middleware.md", "leases of 100 ms"),
    ("docs/mount.md", "250 ms (`QUIET`)"),
];

#[test]
fn no_measured_figure_stands_outside_a_rendered_table() {
    let mut docs = vec![root().join("README.md")];
    docs.extend(
        fs::read_dir(root().join("docs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "md")),
    );
    let mut found = Vec::new();
    for doc in &docs {
        let rel = doc
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let mut table = false;
        for (n, line) in fs::read_to_string(doc).unwrap().lines().enumerate() {
            if line.starts_with("<!-- results:") {
                table = true;
            } else if line.starts_with("<!-- /results:") {
                table = false;
            }
            // A rendered table, or a sentence citing its result file.
            if table || line.contains("results/") {
                continue;
            }
            let allowed = |f: &String| {
                NOT_MEASURED.iter().any(|(d, text)| {
                    *d == rel && line.contains(text) && text.contains(f.split(' ').next().unwrap())
                })
            };
            for f in figures_in(line).into_iter().filter(|f| !allowed(f)) {
                found.push(format!("{rel}:{}: {f}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "measured figures typed by hand (render them from a result file, see \
         docs/results/README.md, or cite the file; a setting belongs in NOT_MEASURED):\n{}",
        found.join("\n")
    );
}

#[test]
fn ratios_to_several_columns_units_in_rows_and_own_decimals() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    fs::create_dir_all(dir.join("docs/results/ovl")).unwrap();
    let row = |op: &str, backend: &str, unit: &str, v: f64| serde_json::json!({"op": op, "backend": backend, "unit": unit, "runs": [v], "median": v});
    let run = serde_json::json!({
        "format": "casfs-bench-result/1", "bench": "ovl", "command": "ovl --reps 1",
        "commit": null, "date": "2026-01-01T00:00:00Z",
        "machine": {"cores": 2, "kernel": "6.1", "filesystem": {}},
        "rows": [
            row("untar", "native", "ms", 100.0),
            row("untar", "floor", "ms", 150.0),
            row("untar", "casfs", "ms", 165.0),
            row("files", "casfs", "files", 3.0),
            // One thing in two units: two rows, not a duplicate.
            row("at start", "casfs", "KiB resident", 2048.0),
            row("at start", "casfs", "descriptors", 17.0),
        ],
    });
    fs::write(dir.join("docs/results/ovl/run.json"), run.to_string()).unwrap();
    let tables = serde_json::json!({
        "t": {"bench": "ovl", "where": {"op": ["untar", "files"]}, "rows": ["op"],
              "columns": "backend", "ratio_to": ["native", "floor"], "unit_in_rows": true,
              "digits": 1, "digits_for": {"files": 0}, "labels": {"untar": "untar small"}},
        "m": {"kind": "figures", "rows": [{"label": "memory", "cells": [
              {"bench": "ovl", "where": {"op": "at start", "unit": "KiB resident"},
               "unit": "MB", "digits": 1, "suffix": " MB"}]}]}
    });
    fs::write(dir.join("docs/results/tables.json"), tables.to_string()).unwrap();
    let doc = dir.join("docs/t.md");
    fs::write(
        &doc,
        "<!-- results:t -->\n<!-- /results:t -->\n\n<!-- results:m -->\n<!-- /results:m -->\n",
    )
    .unwrap();
    let o = render(dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let out = fs::read_to_string(&doc).unwrap();
    for line in [
        "| op | native | floor | casfs |",
        // The second reference shows its ratio to the first; the rest to both.
        "| untar small (ms) | 100.0 | 150.0 (1.50x) | 165.0 (1.65x, 1.10x) |",
        // A label naming its unit is not given it again; a count has no decimals.
        "| files | - | - | 3 |",
        // "KiB resident" converts as KiB: 2,048 KiB is 2.1 MB.
        "| memory | 2.1 MB |",
    ] {
        assert!(
            out.lines().any(|l| l == line),
            "no line {line:?} in:\n{out}"
        );
    }
}
