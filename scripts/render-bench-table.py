#!/usr/bin/env python3
"""Renders the current figures of docs/PERFORMANCE.md from the runs kept in benches/results/.

    python3 scripts/render-bench-table.py [RESULTS_DIR] [--update FILE | --check FILE]

Each CSV file in RESULTS_DIR (default: benches/results) is one run, one figure a line, with the
columns

    table,row,crate,raw,unit,ratio,ratio_lo,ratio_hi,runs,gpu,driver,date,commit

`crate` and `raw` are the crate's figure and the raw-driver reference measured beside it in the
same run (`raw` may be empty where there is none); `ratio` is crate / raw as the run reports it
(the median of the per-round ratios), with the lowest and highest round in `ratio_lo` and
`ratio_hi` (empty: one round, and the ratio is computed from `crate` and `raw`); `date` is
YYYY-MM-DD. A figure (`table`, `row`) measured in several runs shows its newest.

Prints the tables as Markdown. --update FILE writes them into FILE between the lines
`<!-- bench-table:begin -->` and `<!-- bench-table:end -->`; --check FILE exits 1 when FILE's
tables differ from the rendered ones. Standard library only.
"""
import csv
import glob
import os
import sys

COLUMNS = ["table", "row", "crate", "raw", "unit", "ratio", "ratio_lo", "ratio_hi", "runs", "gpu", "driver", "date", "commit"]
BEGIN = "<!-- bench-table:begin -->"
END = "<!-- bench-table:end -->"


def load(folder):
    """The newest figure of each (table, row): runs are read newest first (their file names start
    with the date), tables and rows kept in the order first met."""
    files = sorted(glob.glob(os.path.join(folder, "*.csv")), reverse=True)
    if not files:
        sys.exit(f"{folder}: no *.csv runs")
    figures = {}
    for path in files:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                sys.exit(f"{path}: missing columns {', '.join(missing)}")
            for line, rec in enumerate(reader, start=2):
                for c in ("table", "row", "crate", "unit", "gpu", "date"):
                    if not (rec[c] or "").strip():
                        sys.exit(f"{path}:{line}: empty {c}")
                key = (rec["table"], rec["row"])
                if key not in figures or rec["date"] > figures[key]["date"]:
                    figures[key] = rec
    tables = {}
    for (table, _), rec in figures.items():
        tables.setdefault(table, []).append(rec)
    return list(tables.items())


def number(text, unit):
    """A figure as written in the run, instruction counts with thousands separators."""
    if unit == "instructions":
        return f"{int(float(text)):,}"
    return text


def ratio(rec):
    if rec["ratio"]:
        spread = f" ({rec['ratio_lo']}–{rec['ratio_hi']})" if rec["ratio_lo"] and rec["ratio_hi"] else ""
        return rec["ratio"] + spread
    if rec["raw"]:
        return f"{float(rec['crate']) / float(rec['raw']):.3f}"
    return "—"


def render(tables):
    out = []
    for table, recs in tables:
        out.append(f"**{table}**")
        out.append("")
        out.append("| figure | crate | raw | crate / raw (lowest–highest round) | rounds | measured on |")
        out.append("| --- | ---: | ---: | ---: | ---: | --- |")
        for rec in recs:
            unit = rec["unit"]
            suffix = "" if unit == "instructions" else f" {unit}"
            crate = number(rec["crate"], unit) + suffix
            raw = number(rec["raw"], unit) + suffix if rec["raw"] else "—"
            where = f"{rec['gpu']}, driver {rec['driver']}, {rec['date']}" if rec["driver"] != "double" else f"{rec['gpu']}, {rec['date']}"
            out.append(f"| {rec['row']} | {crate} | {raw} | {ratio(rec)} | {rec['runs'] or 1} | {where} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def splice(path, text):
    doc = open(path, encoding="utf-8").read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{path}: no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return doc, f"{head}{BEGIN}\n{text}{END}{tail}"


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(here, "..", "benches", "results")
    mode = target = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--update", "--check"):
            if not args:
                sys.exit(f"{arg} needs a file")
            mode, target = arg, args.pop(0)
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            folder = arg
    text = render(load(folder))
    if mode is None:
        sys.stdout.write(text)
        return 0
    old, new = splice(target, text)
    if mode == "--check":
        if old != new:
            print(f"{target}: the tables differ from {folder}; run --update", file=sys.stderr)
            return 1
        return 0
    open(target, "w", encoding="utf-8").write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
