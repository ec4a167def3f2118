#!/usr/bin/env bash
# Runs several builds of the transport bench alternately on one GPU machine, so that their
# figures come from the same VM minutes apart (host costs swing 30–50% between VMs of one kind).
#
#   scripts/bench-ab.sh ROUNDS OUTDIR NAME=BINARY [NAME=BINARY ...]
#
# Each round runs every binary once, in the order given, with PPNRT_BENCH_TABLES (default:
# comparison) and writes OUTDIR/NAME.roundN.md; then prints, for each figure of the comparison
# table, every build's crate / raw ratio per round. Build an older commit's bench with
#   git worktree add /tmp/old COMMIT && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo bench --no-run)
# and copy its executable (target/release/deps/transport-*) next to gpu-bundle/.
set -euo pipefail
rounds=$1 out=$2
shift 2
mkdir -p "$out"
tables=${PPNRT_BENCH_TABLES:-comparison}
# BENCH_AB_BUDGET_S (seconds, default none): no round starts that would end past it, judged by
# the longest round so far (a call with a time limit keeps its finished rounds and its summary).
budget=${BENCH_AB_BUDGET_S:-0} began=$(date +%s) longest=0
for round in $(seq 1 "$rounds"); do
  if [ "$budget" -gt 0 ] && [ $(( $(date +%s) - began + longest )) -gt "$budget" ]; then
    echo "round $round not started: the budget of $budget s would be passed (longest round $longest s)"
    break
  fi
  round_began=$(date +%s)
  for pair in "$@"; do
    name=${pair%%=*} binary=${pair#*=}
    start=$(date +%s)
    PPNRT_BENCH_TABLES=$tables PPNRT_BENCH_REPORT="$out/$name.round$round.md" \
      "$binary" --bench zzz_none > "$out/$name.round$round.log" 2>&1 || echo "$name round $round: exit $?"
    echo "$name round $round: $(( $(date +%s) - start )) s"
  done
  longest=$(( $(date +%s) - round_began > longest ? $(date +%s) - round_began : longest ))
done
python3 - "$out" "$rounds" "$@" <<'PY'
import re, sys
out, rounds, pairs = sys.argv[1], int(sys.argv[2]), [p.split("=", 1)[0] for p in sys.argv[3:]]
rows = {}
for name in pairs:
    for r in range(1, rounds + 1):
        try:
            text = open(f"{out}/{name}.round{r}.md").read()
        except OSError:
            continue
        for m in re.finditer(r"^\| ([^|]+) \| ([\d.]+) (µs|GB/s) \| ([\d.]+) (?:µs|GB/s) \| ([\d.]+) \|$", text, re.M):
            rows.setdefault(m.group(1).strip(), {}).setdefault(name, []).append((float(m.group(2)), float(m.group(4)), float(m.group(5))))
        # The `copies` table: "| a -> b size | safe | raw | raw / safe | ..." (µs per copy).
        for m in re.finditer(r"^\| (\d+ -> \d+ [^|]+?) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \|", text, re.M):
            c, w = float(m.group(2)), float(m.group(3))
            rows.setdefault(f"copy back to back {m.group(1).strip()} (µs per copy)", {}).setdefault(name, []).append((c, w, c / w))
        # The `graphs` table: each S's crate rows beside the raw rows they are measured against.
        graphs = {}
        for m in re.finditer(r"^\| S = (\d+): ([^|]+?) \| ([\d.]+) µs \| ([\d.]+) µs \| ([\d.]+) µs \| ([\d.]+) µs \|$", text, re.M):
            graphs[(m.group(1), m.group(2).strip())] = [float(m.group(k)) for k in (3, 4, 5, 6)]
        for (s, variant), figures in graphs.items():
            against = {"crate eager": "raw eager", "crate graph mode": "raw per-stage graphs"}.get(variant)
            if against is None or (s, against) not in graphs:
                continue
            for label, c, w in zip(("host issue", "pipelined step"), (figures[0], figures[2]), (graphs[(s, against)][0], graphs[(s, against)][2])):
                rows.setdefault(f"S = {s} {variant} / {against}: {label}", {}).setdefault(name, []).append((c, w, c / w))
        # The `engine` table: a path's figure beside its raw twin, "A µs ... raw ... B µs".
        for m in re.finditer(r"^\| (deferred readback[^|]*?) \| ([\d.]+) µs \(raw .*? ([\d.]+) µs,", text, re.M):
            c, w = float(m.group(2)), float(m.group(3))
            rows.setdefault(m.group(1).strip(), {}).setdefault(name, []).append((c, w, c / w))
        for m in re.finditer(r"^\| (local 64 MiB single step received in place[^|]*?) \| ([\d.]+) µs .*? vs raw ([\d.]+) µs", text, re.M):
            c, w = float(m.group(2)), float(m.group(3))
            rows.setdefault(m.group(1).strip(), {}).setdefault(name, []).append((c, w, c / w))
def median(values):
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2 if values else float("nan")
print("| figure | " + " | ".join(f"{n} crate/raw per round (median)" for n in pairs) + " |")
print("| --- |" + " --- |" * len(pairs))
for figure, by in rows.items():
    cells = []
    for n in pairs:
        runs = by.get(n, [])
        cells.append(", ".join(f"{c:.2f}/{w:.2f}={q:.3f}" for c, w, q in runs) + f" ({median([q for _, _, q in runs]):.3f})")
    print(f"| {figure} | " + " | ".join(cells) + " |")
# The first build's crate figure against each other build's, round by round (the same VM minutes
# apart): for times below 1 means the first build is faster.
first = pairs[0]
print()
print("| figure | " + " | ".join(f"{first} / {n} crate, per round (median)" for n in pairs[1:]) + " |")
print("| --- |" + " --- |" * (len(pairs) - 1))
for figure, by in rows.items():
    cells = []
    for n in pairs[1:]:
        ratios = [a[0] / b[0] for a, b in zip(by.get(first, []), by.get(n, [])) if b[0]]
        cells.append(", ".join(f"{q:.3f}" for q in ratios) + f" ({median(ratios):.3f})")
    print(f"| {figure} | " + " | ".join(cells) + " |")
# The builds' median crate/raw ratios side by side: the comparison that host-cost swings between
# VMs do not move (both ratios come from the same minutes).
print()
print("| figure | " + " | ".join(f"{n} median crate/raw" for n in pairs) + " | " + " | ".join(f"{first} vs {n}" for n in pairs[1:]) + " |")
print("| --- |" + " ---: |" * (2 * len(pairs) - 1))
for figure, by in rows.items():
    medians = [median([q for _, _, q in by.get(n, [])]) for n in pairs]
    print(f"| {figure} | " + " | ".join(f"{m:.3f}" for m in medians) + " | " + " | ".join(f"{medians[0] / m - 1:+.1%}" for m in medians[1:]) + " |")
PY
