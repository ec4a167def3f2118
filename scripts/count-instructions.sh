#!/usr/bin/env bash
# Counts the instructions the crate's own code executes per hot-path operation, without a GPU:
# runs examples/step_profile.rs under callgrind against the CUDA driver double at two step
# counts and prints the difference per step, for the example binary's own code (every
# instruction of it: the crate and the standard library, whatever source file a line was inlined
# from; not the double, not libc), with the heap allocations per step, and by function (a
# function's own instructions and those inlined into it). Deterministic, so it compares two
# versions of the hot path exactly; it is not a time (the GPU machine's bench is).
#
#   scripts/count-instructions.sh [MODE...]     MODE: peer (default), local, staged, copy, launch, list,
#                                               readback, decode, loop
#
# Needs valgrind (apt-get install valgrind) and a C compiler. LO and HI set the two step counts
# (default 1000 and 3000); TOP how many functions to list (default 12). For `readback` only the
# `PpNRt::readback` call is counted (its method symbol, wherever the impl block lives). ATOMICS=1 also counts the atomic read-modify-writes executed
# in the binary's own code per step (`lock`-prefixed instructions and `xchg` with memory, found by
# objdump, counted by callgrind per instruction), by function. UNCHECKED=1 runs the loop inside
# `Context::bound_unchecked` (step_profile --unchecked): the calls for the current context make no
# context query. For peer, local, staged, copy, launch and list it also counts `loop` (the example's
# loop alone: its counter, its dispatch and a synchronisation every 32 steps, no operation) and
# prints the count less that: the operation alone.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind > /dev/null || { echo "count-instructions: needs valgrind (apt-get install valgrind)"; exit 2; }
command -v callgrind_annotate > /dev/null || { echo "count-instructions: needs callgrind_annotate (valgrind)"; exit 2; }
lo=${LO:-1000} hi=${HI:-3000}
out=target/count
mkdir -p "$out"
rm -f "$out/loop.total"
cc -O2 -shared -fPIC -o "$out/libcuda_double.so" tests/driver_double/cuda_double.c -lpthread -lm
cargo build --release --example step_profile 2> "$out/build.log" || { cat "$out/build.log"; exit 1; }
bin=target/release/examples/step_profile
flags=()
[ "${UNCHECKED:-0}" = 1 ] && flags=(--unchecked)
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(peer)
# The loop alone first, when a mode that it runs beside is asked for (`readback` counts its call
# alone, `decode` a step of 160 launches).
for mode in "${modes[@]}"; do
  case "$mode" in peer|local|staged|copy|launch|list) modes=(loop "${modes[@]}"); break ;; esac
done
for mode in "${modes[@]}"; do
  # Per instruction (addresses, absolute positions, full names): every instruction of the binary's
  # own code is counted, library and crate code inlined from other files included.
  toggle=(--dump-instr=yes --compress-pos=no --compress-strings=no)
  [ "$mode" = readback ] && toggle+=(--collect-atstart=no "--toggle-collect=*<impl ppnrt::pp::runtime::PpNRt>::readback")
  for n in "$lo" "$hi"; do
    PPNRT_LIBCUDA_PATH="$PWD/$out/libcuda_double.so" PPNRT_DOUBLE_DEVICES=2 \
      valgrind --tool=callgrind "${toggle[@]}" --callgrind-out-file="$out/$mode.$n" "$bin" "$mode" "$n" "${flags[@]}" \
      > "$out/$mode.$n.log" 2>&1 || { tail -5 "$out/$mode.$n.log"; exit 1; }
  done
  python3 - "$bin" "$out/$mode" "$lo" "$hi" "$mode" <<'PY'
import os, re, subprocess, sys
binary, base, lo, hi, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
name = os.path.basename(binary)
top = int(os.environ.get("TOP", "12"))

def per_instruction(path):
    """Instructions executed at each address of the binary, with the function each lies in (the
    cost lines of its functions, not the inclusive costs that follow a `calls=` line): the
    binary's own code, whatever source file a line was inlined from."""
    counts, where, ob, fn, after_call = {}, {}, None, None, False
    for line in open(path):
        if line.startswith("ob="):
            ob = line[3:].strip()
        elif line.startswith("fn="):
            fn = line[3:].strip()
        elif line.startswith("calls="):
            after_call = True
        elif line.startswith("0x"):
            if not after_call and ob and os.path.basename(ob) == name:
                addr, _line, cost = line.split()[:3]
                addr = int(addr, 16)
                counts[addr] = counts.get(addr, 0) + int(cost)
                where[addr] = fn
            after_call = False
    return counts, where

def allocations(path):
    tree = subprocess.run(["callgrind_annotate", "--tree=caller", path], capture_output=True, text=True).stdout
    found = 0
    for line in tree.splitlines():
        m = re.search(r"< .*__rdl_alloc \(([\d,]+)x\)", line)
        if m:
            found += int(m.group(1).replace(",", ""))
    return found

(a, _), (b, where) = per_instruction(f"{base}.{lo}"), per_instruction(f"{base}.{hi}")
steps = hi - lo
per = {addr: (b.get(addr, 0) - a.get(addr, 0)) / steps for addr in set(a) | set(b)}
by_function = {}
for addr, n in per.items():
    function = where.get(addr, "?")
    by_function[function] = by_function.get(function, 0) + n
alloc = (allocations(f"{base}.{hi}") - allocations(f"{base}.{lo}")) / steps
total = sum(per.values())
print(f"{mode}{' (unchecked binding)' if os.environ.get('UNCHECKED', '0') == '1' else ''}: {total:.0f} instructions of the crate's own code per step, "
      f"{alloc:.2f} heap allocations per step")
# The loop alone (mode `loop`, counted first): what every other mode's count holds beside its
# operation.
loop_total = os.path.join(os.path.dirname(base), "loop.total")
if mode == "loop":
    open(loop_total, "w").write(f"{total}\n")
elif mode in ("peer", "local", "staged", "copy", "launch", "list") and os.path.exists(loop_total):
    alone = float(open(loop_total).read())
    print(f"  the operation alone: {total - alone:.0f} (less the example's loop, {alone:.0f} a step)")
for function, n in sorted(by_function.items(), key=lambda kv: -kv[1])[:top]:
    if n >= 5:
        print(f"  {n:7.1f}  {function[:110]}")
if os.environ.get("ATOMICS", "0") != "1":
    sys.exit(0)
listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", binary], capture_output=True, text=True,
                         check=True).stdout
atomic, function = {}, None
for line in listing.splitlines():
    m = re.match(r"^([0-9a-f]+) <(.*)>:$", line)
    if m:
        function = m.group(2)
        continue
    if re.match(r"^\s+[0-9a-f]+:\s+(lock |xchg\s+\S+,\()", line):
        atomic[int(line.split(":")[0], 16)] = function
by = {}
for addr, function in atomic.items():
    n = per.get(addr, 0)
    if n > 0:
        by[function] = by.get(function, 0) + n
print(f"  {sum(by.values()):.1f} atomic read-modify-writes per step in the binary's own code:")
for function, n in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
    if n >= 0.05:
        print(f"  {n:7.1f}  {function[:110]}")
PY
done
