#!/usr/bin/env bash
# Builds the release test, example and bench executables on this machine (the GPU machine has
# no Rust) and stages them in gpu-bundle/ (ignored by git), with the gate script beside them.
# Then run the gate on a GPU machine from the repository root:  bash scripts/gpu-gate.sh
# (carrying gpu-bundle/, or gpu-bundle.tgz when the bundle is past the device tool's 64 MiB).
# gpu-bundle/tiers names each test executable's tier, one "NAME TIER" a line: host, double or
# gpu (its folder under tests/), unit (the library's own tests); the gate picks by tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/examples" "$bundle/benches"

# Reads cargo's JSON messages on stdin; copies each executable of the given target kinds.
stage() {
  python3 -c '
import json, shutil, subprocess, sys, os
dest, kinds = sys.argv[1], set(sys.argv[2].split(","))
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    exe = msg.get("executable")
    if msg.get("reason") != "compiler-artifact" or not exe:
        continue
    kind = msg["target"]["kind"][0]
    if kind not in kinds:
        continue
    name = msg["target"]["name"] if kind != "lib" else "unit"
    target = os.path.join(dest, name)
    if kind in ("test", "lib"):
        parts = os.path.relpath(msg["target"]["src_path"], os.getcwd()).split(os.sep)
        tier = parts[1] if kind == "test" and len(parts) > 2 and parts[0] == "tests" else "unit"
        with open(os.path.join(os.path.dirname(dest), "tiers"), "a") as tiers:
            print(name, tier, file=tiers)
    shutil.copy2(exe, target)
    # Debug sections make each executable ~9 MB; the bundle must travel light.
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-debug", target], check=True)
    print(f"staged {dest}/{name}")
' "$1" "$2"
}

cargo test --release --no-run --features cudarc --message-format=json | stage "$bundle/tests" test,lib
cargo build --release --examples --message-format=json | stage "$bundle/examples" example
cargo bench --no-run --message-format=json | stage "$bundle/benches" bench
du -sh "$bundle"
# The device tool carries at most 64 MiB: the bundle also goes compressed, which the gate unpacks
# when it finds no gpu-bundle/ (carry gpu-bundle.tgz instead of gpu-bundle/ when the latter is
# too large).
tar czf gpu-bundle.tgz "$bundle"
du -sh gpu-bundle.tgz
