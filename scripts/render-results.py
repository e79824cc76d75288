#!/usr/bin/env python3
"""Renders the tables of README.md and docs/*.md from the result files under docs/results/.

Every table between `<!-- results:NAME -->` and `<!-- /results:NAME -->` is rewritten
from the newest result file of the benchmark that docs/results/tables.json names for
NAME, with a line under it saying which file it comes from and where the earlier runs
are. docs/results/README.md describes the result files and the table definitions.

  scripts/render-results.py            rewrite the tables in place
  scripts/render-results.py --check    change nothing; exit 1 if a table differs
  scripts/render-results.py --root DIR the same for another tree (README.md, docs/)
"""

import argparse
import difflib
import json
import math
import os
import re
import sys
import textwrap

FORMAT = "casfs-bench-result/1"
# A marker stands alone on its line (one quoted in prose is no marker).
MARKER = re.compile(
    r"^(<!-- results:(?P<name>[A-Za-z0-9_.-]+) -->\n)(?P<body>.*?)^(<!-- /results:(?P=name) -->)$",
    re.S | re.M,
)
OPEN = re.compile(r"^<!-- /?results:([A-Za-z0-9_.-]+) -->$", re.M)
# Factors from a row's unit to the unit a table asks for.
UNITS = {
    ("ms", "s"): 1e-3,
    ("ms", "us"): 1e3,
    ("us", "ms"): 1e-3,
    ("s", "ms"): 1e3,
    ("B", "KiB"): 1 / 1024,
    ("B", "MiB"): 1 / 2**20,
    ("B", "GiB"): 1 / 2**30,
    ("B", "kB"): 1e-3,
    ("B", "MB"): 1e-6,
    ("B", "GB"): 1e-9,
    ("KiB", "MiB"): 1 / 1024,
    ("KiB", "MB"): 1024 / 1e6,
    ("KiB", "GiB"): 1 / 2**20,
}
ROW_FIELDS = ("unit", "runs", "median")
# The width the line under a table is wrapped to.
WIDTH = 100


class Failure(Exception):
    pass


def median(runs):
    s = sorted(runs)
    return s[len(s) // 2]


def check_result(path, r):
    """The problems of result file `path` (parsed as `r`), as text."""
    bad = []
    if not isinstance(r, dict):
        return [f"{path}: not a JSON object"]
    if r.get("format") != FORMAT:
        bad.append(f"{path}: format is {r.get('format')!r}, not {FORMAT!r}")
    for k in ("bench", "command", "date"):
        if not isinstance(r.get(k), str) or not r.get(k):
            bad.append(f"{path}: no {k!r}")
    if "commit" not in r:
        bad.append(f"{path}: no 'commit'")
    m = r.get("machine")
    if not isinstance(m, dict) or not isinstance(m.get("cores"), int) or not m.get("kernel"):
        bad.append(f"{path}: 'machine' needs 'cores' and 'kernel'")
    elif not isinstance(m.get("filesystem"), dict):
        bad.append(f"{path}: 'machine' has no 'filesystem'")
    rows = r.get("rows")
    if not isinstance(rows, list) or not rows:
        bad.append(f"{path}: no 'rows'")
        return bad
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            bad.append(f"{where}: not an object")
            continue
        runs = row.get("runs")
        if not isinstance(row.get("unit"), str):
            bad.append(f"{where}: no 'unit'")
        if (
            not isinstance(runs, list)
            or not runs
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in runs)
        ):
            bad.append(f"{where}: 'runs' must be a non-empty list of numbers")
            continue
        med = row.get("median")
        close = isinstance(med, (int, float)) and math.isclose(
            med, median(runs), rel_tol=1e-9, abs_tol=1e-9
        )
        if not close:
            bad.append(f"{where}: 'median' {med!r} is not the median of its runs ({median(runs)!r})")
        # Labels and unit: one thing may be measured in two units (descriptors and KiB
        # at start).
        key = json.dumps({k: v for k, v in row.items() if k not in ("runs", "median")}, sort_keys=True)
        if key in seen:
            bad.append(f"{where}: the same labels as an earlier row ({key})")
        seen.add(key)
    return bad


class Results:
    """The result files under `<root>/docs/results/`, by benchmark folder."""

    def __init__(self, root):
        self.root = root
        self.dir = os.path.join(root, "docs", "results")
        self.files = {}  # relative path -> parsed file
        self.selection = {}  # a picked file -> the runs it was picked from, oldest first
        self.problems = []
        for d, _, names in os.walk(self.dir):
            for n in sorted(names):
                if not n.endswith(".json") or (d == self.dir and n == "tables.json"):
                    continue
                p = os.path.join(d, n)
                rel = os.path.relpath(p, root)
                try:
                    with open(p, encoding="utf-8") as f:
                        r = json.load(f)
                except (OSError, ValueError) as e:
                    self.problems.append(f"{rel}: {e}")
                    continue
                self.problems += check_result(rel, r)
                self.files[rel] = r

    def runs_of(self, bench):
        """The files of `bench`, oldest first (by date, then name)."""
        got = [(r.get("date", ""), p) for p, r in self.files.items() if r.get("bench") == bench]
        return [p for _, p in sorted(got)]

    def pick(self, spec, what):
        """The file a table or cell reads: `file`, or the newest of `bench`."""
        if "file" in spec:
            p = spec["file"]
            if p not in self.files:
                raise Failure(f"{what}: no result file {p}")
            return p
        bench = spec.get("bench")
        if not bench:
            raise Failure(f"{what}: names neither 'bench' nor 'file'")
        runs = self.runs_of(bench)
        # Runs of one benchmark with different settings (a backend, a workload): only
        # those whose command has every one of these words, and none of `command_lacks`.
        has = spec.get("command_has", [])
        lacks = spec.get("command_lacks", [])
        has, lacks = ([has] if isinstance(has, str) else has), ([lacks] if isinstance(lacks, str) else lacks)
        runs = [
            q for q in runs
            if all(w in self.files[q].get("command", "") for w in has)
            and not any(w in self.files[q].get("command", "") for w in lacks)
        ]
        if not runs:
            raise Failure(
                f"{what}: no result file of bench {bench!r} under docs/results/"
                + (f" whose command has {has} and not {lacks}" if has or lacks else "")
            )
        # The earlier runs a table names are those of the same selection.
        self.selection[runs[-1]] = runs
        return runs[-1]


def matches(row, where):
    for k, v in (where or {}).items():
        want = v if isinstance(v, list) else [v]
        if row.get(k) not in want:
            return False
    return True


def convert(row, unit, what):
    have = row.get("unit")
    if not unit or unit == have:
        return 1.0
    # A unit with a word after it ("KiB resident") converts as its unit.
    have = have.split(" ")[0] if isinstance(have, str) else have
    if have == unit:
        return 1.0
    if (have, unit) not in UNITS:
        raise Failure(f"{what}: cannot convert {have!r} to {unit!r}")
    return UNITS[(have, unit)]


def number(v, digits):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def label_text(v):
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def link(from_md, rel, root):
    """A Markdown link to `rel` (relative to the root) from the file `from_md`."""
    target = os.path.relpath(os.path.join(root, rel), os.path.dirname(os.path.join(root, from_md)))
    return f"[`{os.path.basename(rel)}`]({target})"


def describe(r):
    m = r.get("machine", {})
    fs = m.get("filesystem") or {}
    commit = (r.get("commit") or "no commit")[:7] + ("+" if r.get("commit_dirty") else "")
    parts = [r.get("date", "?")[:10], f"commit {commit}", f"{m.get('cores', '?')} cores",
             f"kernel {m.get('kernel', '?')}"]
    if fs.get("type"):
        parts.append(f"{fs['type']} at {m.get('bench_dir', '?')}")
    if r.get("profile") and r.get("profile") != "release":
        parts.append(f"{r['profile']} build")
    return ", ".join(parts)


def shown_command(r):
    """A result's command as a reader would type it in a checkout: a path into the
    repository's docs/results/ given as an absolute path of the checkout it ran in is
    shown relative to the checkout's root."""
    return re.sub(r"(?<=\s)/\S*/(docs/results/)", r"\1", r.get("command", ""))


def source_line(results, files, from_md, shown_runs):
    """The line under a table: the file(s) it comes from and the earlier runs."""
    out = []
    for p in files:
        r = results.files[p]
        bench = r.get("bench")
        date = r.get("date", "")
        older = [
            q
            for q in results.selection.get(p, results.runs_of(bench))
            if q != p and results.files[q].get("date", "") <= date
        ]
        s = f"From {link(from_md, p, results.root)} ({describe(r)}): `{shown_command(r)}`"
        if older:
            folder = os.path.dirname(p)
            shown = ", ".join(link(from_md, q, results.root) for q in reversed(older[-3:]))
            more = f" ({len(older)} in all in `{folder}/`)" if len(older) > 3 else ""
            s += f". Earlier runs: {shown}{more}"
        out.append(s + ".")
    if shown_runs:
        lo, hi = min(shown_runs), max(shown_runs)
        reps = f"{lo}" if lo == hi else f"{lo}-{hi}"
        out.append(f"Medians of {reps} run{'s' if hi > 1 else ''} each.")
    # Wrapped like the prose around it (a link or a word is never split).
    return textwrap.fill(" ".join(out), WIDTH, break_long_words=False, break_on_hyphens=False)


def render_pivot(name, spec, results, from_md):
    p = results.pick(spec, f"table {name}")
    r = results.files[p]
    value = spec.get("value", "median")
    digits = spec.get("digits", 1)
    rows_by = spec.get("rows") or []
    col_by = spec.get("columns")
    unit = spec.get("unit")
    cells = {}
    row_keys, col_keys, run_counts, units = [], [], [], set()
    row_units = {}
    for row in r["rows"]:
        if not matches(row, spec.get("where")):
            continue
        missing = [k for k in rows_by + ([col_by] if col_by else []) if k not in row]
        if missing:
            continue
        rk = tuple(row[k] for k in rows_by)
        ck = row[col_by] if col_by else "value"
        if (rk, ck) in cells:
            raise Failure(f"table {name}: two rows of {p} for {dict(zip(rows_by, rk))}, {ck!r}: "
                          "narrow 'where' or add a label to 'rows'")
        f = convert(row, unit, f"table {name}")
        v = row.get(value)
        cells[(rk, ck)] = v * f if isinstance(v, (int, float)) else v
        units.add(unit or row.get("unit"))
        row_units.setdefault(rk, unit or row.get("unit"))
        run_counts.append(len(row["runs"]))
        if rk not in row_keys:
            row_keys.append(rk)
        if ck not in col_keys:
            col_keys.append(ck)
    if not cells:
        raise Failure(f"table {name}: no row of {p} matches {spec.get('where')}")
    order = spec.get("column_order")
    if order:
        col_keys = [c for c in order if c in col_keys] + [c for c in col_keys if c not in order]
    rorder = spec.get("row_order")
    if rorder:
        # An entry is a row's labels in `rows` order, or its one label (bare or in a list).
        def key(labels):
            labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
            return json.dumps(labels if len(labels) > 1 else labels[0])

        pos = {key(k): i for i, k in enumerate(rorder)}
        row_keys.sort(key=lambda k: pos.get(key(k), len(pos)))
    names = spec.get("labels", {})
    u = units.pop() if len(units) == 1 else None
    head = [names.get(k, k) for k in rows_by]
    in_head = f" ({u})" if u and spec.get("unit_in_head", True) and not spec.get("unit_in_rows") else ""
    head += [names.get(str(c), label_text(c)) + in_head for c in col_keys]
    # One column or several: a cell shows its ratio to each of them (but itself).
    ratio_to = spec.get("ratio_to")
    ratio_cols = ratio_to if isinstance(ratio_to, list) else ([] if ratio_to is None else [ratio_to])
    lines = []
    if spec.get("title"):
        lines += [spec["title"], ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(rows_by) + "---:|" * len(col_keys))
    for rk in row_keys:
        out = [names.get(str(x), label_text(x)) for x in rk]
        # A label that names its unit already ("chunks") is not given it again.
        if spec.get("unit_in_rows") and out and row_units[rk] not in out[-1].replace(",", " ").split():
            out[-1] += f" ({row_units[rk]})"
        for ck in col_keys:
            v = cells.get((rk, ck))
            # Counts need no decimals: `digits_for` sets them by row or column label.
            per = spec.get("digits_for", {})
            d = per.get(str(ck), per.get(str(rk[-1]) if rk else "", digits))
            s = number(v, d) if isinstance(v, (int, float)) or v is None else str(v)
            ratios = []
            # A reference column shows its ratio to the references before it only.
            refs = ratio_cols[: ratio_cols.index(ck)] if ck in ratio_cols else ratio_cols
            for t in refs:
                ref = cells.get((rk, t))
                if ck != t and isinstance(v, (int, float)) and isinstance(ref, (int, float)) and ref:
                    ratios.append(f"{v / ref:.{spec.get('ratio_digits', 2)}f}x")
            if ratios:
                s += f" ({', '.join(ratios)})"
            out.append(s)
        lines.append("| " + " | ".join(out) + " |")
    lines += ["", source_line(results, [p], from_md, run_counts if value == "median" else [])]
    return "\n".join(lines)


def render_cell(name, cell, results, used, run_counts):
    if isinstance(cell, str):
        return cell
    p = results.pick(cell, f"table {name}")
    if p not in used:
        used.append(p)
    rows = [row for row in results.files[p]["rows"] if matches(row, cell.get("where"))]
    each = cell.get("each")
    if not rows:
        raise Failure(f"table {name}: no row of {p} matches {cell.get('where')}")
    if not each and len(rows) > 1:
        raise Failure(f"table {name}: {len(rows)} rows of {p} match {cell.get('where')}: "
                      "narrow 'where' or give 'each'")
    if each:
        rows = [row for row in rows if each in row]
        if "each_order" in cell:
            order = cell["each_order"]
            rows.sort(key=lambda row: order.index(row[each]) if row[each] in order else len(order))
        keys = [row[each] for row in rows]
        if len(set(map(json.dumps, keys))) != len(keys):
            raise Failure(f"table {name}: several rows of {p} per {each!r} match {cell.get('where')}")
    vals = []
    for row in rows:
        v = row.get(cell.get("value", "median"))
        v = v * convert(row, cell.get("unit"), f"table {name}") if isinstance(v, (int, float)) else v
        vals.append(number(v, cell.get("digits", 1)) if isinstance(v, (int, float)) else str(v))
        run_counts.append(len(row["runs"]))
    return cell.get("prefix", "") + cell.get("join", " / ").join(vals) + cell.get("suffix", "")


def render_figures(name, spec, results, from_md):
    used, run_counts = [], []
    head = spec.get("head") or []
    lines = []
    if spec.get("title"):
        lines += [spec["title"], ""]
    width = max([len(head)] + [1 + len(r.get("cells", [])) for r in spec.get("rows", [])])
    head = head + [""] * (width - len(head))
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * width)
    for row in spec.get("rows", []):
        cells = [render_cell(name, c, results, used, run_counts) for c in row.get("cells", [])]
        cells += [""] * (width - 1 - len(cells))
        lines.append("| " + " | ".join([row.get("label", "")] + cells) + " |")
    if spec.get("sources") == "brief":
        lines += ["", brief_source_line(results, used, from_md, run_counts)]
    else:
        lines += ["", source_line(results, used, from_md, run_counts)]
    return "\n".join(lines)


def brief_source_line(results, files, from_md, run_counts):
    """The line under a table of figures from many benchmarks (the README's headline):
    each benchmark's file, named by the benchmark; its machine, date and command are
    under that benchmark's own table."""
    seen = []
    for p in files:
        if p not in seen:
            seen.append(p)
    named = ", ".join(
        f"[{results.files[p].get('bench', os.path.basename(os.path.dirname(p)))}]"
        f"({os.path.relpath(os.path.join(results.root, p), os.path.dirname(os.path.join(results.root, from_md)))})"
        for p in seen
    )
    lo, hi = min(run_counts), max(run_counts)
    reps = f"{lo}" if lo == hi else f"{lo}-{hi}"
    s = (f"From the newest run of each benchmark: {named}; each one's machine, date and "
         f"command are under its table in docs/benchmarks.md. Medians of {reps} "
         f"run{'s' if hi > 1 else ''} each.")
    return textwrap.fill(s, WIDTH, break_long_words=False, break_on_hyphens=False)


def render(name, spec, results, from_md):
    kind = spec.get("kind", "pivot")
    if kind == "pivot":
        return render_pivot(name, spec, results, from_md)
    if kind == "figures":
        return render_figures(name, spec, results, from_md)
    raise Failure(f"table {name}: unknown kind {kind!r}")


def docs_of(root):
    out = []
    if os.path.exists(os.path.join(root, "README.md")):
        out.append("README.md")
    d = os.path.join(root, "docs")
    if os.path.isdir(d):
        out += [os.path.join("docs", n) for n in sorted(os.listdir(d)) if n.endswith(".md")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    root = a.root
    results = Results(root)
    tables_path = os.path.join(root, "docs", "results", "tables.json")
    tables = {}
    if os.path.exists(tables_path):
        with open(tables_path, encoding="utf-8") as f:
            tables = json.load(f)
    problems = list(results.problems)
    stale = []
    for md in docs_of(root):
        path = os.path.join(root, md)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # Every marker opens and closes once, in pairs.
        opened = OPEN.findall(text)
        pairs = MARKER.findall(text)
        if len(opened) != 2 * len(pairs):
            problems.append(
                f"{md}: a <!-- results:NAME --> marker without its <!-- /results:NAME --> "
                "(or the other way)"
            )
            continue

        def replace(m):
            name = m.group("name")
            if name not in tables:
                problems.append(f"{md}: table {name} is not in docs/results/tables.json")
                return m.group(0)
            try:
                body = render(name, tables[name], results, md)
            except Failure as e:
                problems.append(f"{md}: {e}")
                return m.group(0)
            return m.group(1) + body + "\n" + m.group(4)

        new = MARKER.sub(replace, text)
        if new != text:
            stale.append(md)
            if a.check:
                diff = difflib.unified_diff(
                    text.splitlines(),
                    new.splitlines(),
                    f"{md} (now)",
                    f"{md} (from the result files)",
                    lineterm="",
                )
                sys.stdout.write("\n".join(diff) + "\n")
            else:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    for p in problems:
        print(f"render-results: {p}", file=sys.stderr)
    if a.check and stale:
        print(f"render-results: tables differ from the result files in {', '.join(stale)}; "
              "run scripts/render-results.py", file=sys.stderr)
    if problems or (a.check and stale):
        sys.exit(1)
    if not a.check:
        for md in stale:
            print(f"render-results: rewrote {md}")


if __name__ == "__main__":
    main()
