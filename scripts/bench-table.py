#!/usr/bin/env python3
"""Prints the current-table rows of docs/PERFORMANCE.md from a folder of scripts/bench-ab.sh runs.

    python3 scripts/bench-table.py AB_FOLDER HEAD_NAME BASE_NAME

For every figure the two builds share (the comparison table's boundaries, the graphs table's
eager and graph-mode steps beside their raw references, the engine table's paths beside theirs):
the newer build's median crate and raw figures, its median crate/raw ratio with the lowest and
highest of its runs, the older build's, and the difference of the two medians.
"""
import glob
import re
import statistics
import sys


def rows(folder, name):
    out = {}
    for path in sorted(glob.glob(f"{folder}/{name}.round*.md")):
        text = open(path).read()
        for m in re.finditer(r"^\| ([^|]+) \| ([\d.]+) (µs|GB/s) \| ([\d.]+) (?:µs|GB/s) \| ([\d.]+) \|$", text, re.M):
            out.setdefault(m.group(1).strip(), []).append((float(m.group(2)), float(m.group(4)), m.group(3)))
        graphs = {}
        for m in re.finditer(r"^\| S = (\d+): ([^|]+?) \| ([\d.]+) µs \| ([\d.]+) µs \| ([\d.]+) µs \| ([\d.]+) µs \|$", text, re.M):
            graphs[(m.group(1), m.group(2).strip())] = [float(m.group(k)) for k in (3, 4, 5, 6)]
        for s in sorted({s for s, _ in graphs}, key=int):
            if (s, "crate eager") not in graphs:
                continue
            eager, raw_eager = graphs[(s, "crate eager")], graphs[(s, "raw eager")]
            graph, per_stage = graphs[(s, "crate graph mode")], graphs[(s, "raw per-stage graphs")]
            out.setdefault(f"S = {s}: eager, host issue per step", []).append((eager[0], raw_eager[0], "µs"))
            out.setdefault(f"S = {s}: graph mode against raw per-stage graphs, host issue per step", []).append((graph[0], per_stage[0], "µs"))
            out.setdefault(f"S = {s}: graph mode against raw per-stage graphs, pipelined step", []).append((graph[2], per_stage[2], "µs"))
        for m in re.finditer(r"^\| (deferred readback[^|]*?) \| ([\d.]+) µs \(raw .*? ([\d.]+) µs,", text, re.M):
            out.setdefault(m.group(1).strip(), []).append((float(m.group(2)), float(m.group(3)), "µs"))
    return out


def main():
    folder, head, base = sys.argv[1:4]
    new, old = rows(folder, head), rows(folder, base)
    print("| figure | crate (median) | raw (median) | crate / raw, median (lowest–highest) | older build, median (lowest–highest) | difference of the medians |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for figure, runs in new.items():
        ratios = [c / r for c, r, _ in runs]
        cell = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
        unit = runs[0][2]
        line = f"| {figure} | {statistics.median(c for c, _, _ in runs):.2f} {unit} | {statistics.median(r for _, r, _ in runs):.2f} {unit} | {cell} |"
        if figure in old:
            older = [c / r for c, r, _ in old[figure]]
            diff = statistics.median(ratios) / statistics.median(older) - 1
            line += f" {statistics.median(older):.3f} ({min(older):.3f}–{max(older):.3f}) | {diff:+.1%} |"
        else:
            line += " — | — |"
        print(line)


if __name__ == "__main__":
    main()
