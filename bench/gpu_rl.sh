#!/bin/sh
# `tlt bench rl --device cuda --size gpu` on a GPU node that has python3 with torch and no Ray, Redis, FastAPI...
# and no internet, from the offline bundle's parts (docs/operations.md, "RL on one GPU: bench/gpu_rl.sh").
#
#   sh bench/gpu_rl.sh prepare [PARTS_DIR]   here: one folder per transfer, dist/gpu-rl/1..N, each holding one
#                                            part of `make bundle ... SPLIT=43M` (PARTS_DIR, default
#                                            dist/bundle-parts) with parts.json and unpack.py; refuses parts
#                                            that do not fit a call beside the tree (the tree travels with each)
#   sh bench/gpu_rl.sh node DIR              on the node, once per folder, in order: keeps DIR's part in
#                                            $TLT_PARTS (default /tmp/tlt-parts, outside the tree: it survives
#                                            between calls while the machine is held) and says which are still to
#                                            come; once all are there, unpacks and checks them (unpack.py: sizes and
#                                            sha256), installs the bundle (once), and runs the bench from this tree
#
# The bench writes rl_gpu.json, its log, rl_progress.json (the finished jobs' steps, rewritten after each job: what
# is left of a run stopped at the call's limit) and the install's log under $OUT (default artifacts/gpu-rl).
# Environment:
#   TLT_VENV     where the bundle installs (default /tmp/tlt-venv: made by the bundle's install.sh over python3,
#                which sees the node's torch, also where python3 is a venv itself, as on the lent nodes)
#   RL_ARGS      more options of the bench, e.g. "--steps 3 --max-seconds 400"
#   RL_TESTS=1   first the CUDA cases of the bf16 worker's test (tests/workers/test_policy_dtype.py, ~20 s)
#   RL_TIMEOUT   seconds the bench may run before it is stopped (default: what is left of 590 s since this
#                script started, the install included: inside a device call's 600 s, with the log kept)
#   RL_BENCH     the bench's device and size (default "--device cuda --size gpu"; the CPU test of this script
#                runs "--device cpu --size smallest")
#   TLT_CARRY    where prepare lays out the folders (default dist/gpu-rl: ignored by git, as a carry must be)
#   TLT_TRANSFER_LIMIT  the bytes one call carries, the tree included (default 67108864: a lent machine's 64 MiB)
set -eu
die() { echo "gpu_rl.sh: $*" >&2; exit 1; }

prepare() {
  parts=${1:-dist/bundle-parts}
  [ -f "$parts/parts.json" ] || die "no parts.json in $parts: build the parts first (make bundle ... SPLIT=43M)"
  carry=${TLT_CARRY:-dist/gpu-rl}
  # a call carries the whole tree beside its folder, within the limit (deploy/transfer.py)
  python3 deploy/transfer.py "$parts" ${TLT_TRANSFER_LIMIT:+--limit "$TLT_TRANSFER_LIMIT"} || exit 1
  rm -rf "$carry"
  names=$(python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(open(sys.argv[1]))["parts"]))' \
    "$parts/parts.json")
  i=0
  for name in $names; do
    i=$((i + 1))
    mkdir -p "$carry/$i"
    for f in "$parts/$name" "$parts/parts.json" "$parts/unpack.py"; do
      ln "$f" "$carry/$i/" 2>/dev/null || cp "$f" "$carry/$i/"
    done
  done
  echo "$carry/1..$i: one part each. The device calls, back to back on one held machine (it goes back after"
  echo "30 s idle; then start again at 1); the last one installs and runs the bench (about 8 minutes):"
  for j in $(seq 1 "$i"); do
    limit=120
    [ "$j" = "$i" ] && limit=600
    echo "  run(command=\"sh bench/gpu_rl.sh node $carry/$j\", carry=[\"$carry/$j\"], timeout_s=$limit)"
  done
}

node() {
  started=$(date +%s)
  src=${1:?"usage: sh bench/gpu_rl.sh node DIR (a folder of dist/gpu-rl)"}
  [ -d "$src" ] || die "no folder $src in this tree: carry it (run's carry=[\"$src\"])"
  stash=${TLT_PARTS:-/tmp/tlt-parts}
  out=${OUT:-artifacts/gpu-rl}
  mkdir -p "$stash" "$out"
  cp "$src"/* "$stash"/
  [ -f "$stash/parts.json" ] || die "no parts.json among the parts carried so far ($stash)"
  missing=$(python3 -c '
import json, os, sys
manifest = json.load(open(os.path.join(sys.argv[1], "parts.json")))
print(" ".join(p["name"] for p in manifest["parts"] if not os.path.isfile(os.path.join(sys.argv[1], p["name"]))))
' "$stash")
  if [ -n "$missing" ]; then
    echo "gpu_rl.sh: kept $(ls "$src" | grep -v -e parts.json -e unpack.py | tr '\n' ' ')in $stash; still to carry: $missing"
    return 0
  fi

  venv=${TLT_VENV:-/tmp/tlt-venv}
  stamp=$(sha256sum "$stash/parts.json" | cut -d' ' -f1)
  if [ "$(cat "$stash/.installed" 2>/dev/null)" != "$stamp" ]; then
    echo "gpu_rl.sh: all parts here; unpacking, checking and installing into $venv"
    t0=$(date +%s)
    PYTHON=python3 python3 "$stash/unpack.py" --parts "$stash" --force --install "$venv" \
      >"$out/install.log" 2>&1 || { tail -30 "$out/install.log" >&2; die "the install failed ($out/install.log)"; }
    tail -5 "$out/install.log"
    echo "$stamp" >"$stash/.installed"
    echo "gpu_rl.sh: installed in $(( $(date +%s) - t0 )) s"
  fi

  # this tree's code, whatever the bundle's wheel holds; Ray's workers inherit the environment
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export TLT_CACHE_DIR=${TLT_CACHE_DIR:-/tmp/tlt-cache}
  py="$venv/bin/python"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
  if [ "${RL_TESTS:-0}" = 1 ]; then
    "$py" -m pytest -q -k cuda -p no:cacheprovider tests/workers/test_policy_dtype.py 2>&1 | tee "$out/tests.log" |
      tail -3
  fi
  bench=${RL_BENCH:---device cuda --size gpu}
  limit=${RL_TIMEOUT:-$((590 - ($(date +%s) - started)))}
  echo "gpu_rl.sh: tlt bench rl $bench ${RL_ARGS:-} (log: $out/rl_gpu.log)"
  set +e
  # shellcheck disable=SC2086  # the options, split on purpose
  timeout "$limit" "$py" -m bench.cli rl $bench --json --out-dir "$out" --progress-file "$out/rl_progress.json" \
    ${RL_ARGS:-} \
    >"$out/rl_gpu.stdout" 2>"$out/rl_gpu.log"
  rc=$?
  set -e
  grep -e "^warm draft" -e "job [0-9a-f]* " -e "not started" -e "Error" -e "error" "$out/rl_gpu.log" | tail -25 || true
  result="$out/rl_gpu.json"
  [ -f "$result" ] || result="$out/rl.json"  # a CPU run's name
  [ -f "$result" ] && "$py" -c '
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("rollout_speedup", "step_speedup", "tlt_vs_frozen_rollout_speedup", "reclaimed_ratio", "reward_delta_se",
        "accepted_length_last_step_tlt", "accepted_length_last_step_frozen", "seconds", "warm_start_s",
        "num_repeats_done")
for k in keys:
    print(f"{k:36s} {r.get(k)}")
print("goals_met", r.get("goals_met"))
' "$result"
  [ "$rc" = 0 ] || die "the bench exited $rc (124: stopped after $limit s); $out/rl_gpu.log has its log"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  node) shift; node "$@" ;;
  *) die "usage: sh bench/gpu_rl.sh prepare [PARTS_DIR] | node DIR" ;;
esac
