#!/usr/bin/env bash
# One command at this tree and at an older one on the same CUDA machine, alternated (from the repo root):
#   bash ops/gpu_ab.sh OUT_DIR REV ROUNDS -- python3 -m ops.bench_decode --device cuda ...
# REV is a commit of this repository, written out with `git archive` beside the checkout before the call (carry it:
# the machine has no git history): `mkdir .ab_old && git archive REV | tar -x -C .ab_old`, named in the call's carry
# and in .git/info/exclude. Each round runs the command here, then in .ab_old with that tree on PYTHONPATH; the
# output goes to OUT_DIR/new.log and OUT_DIR/old.log, and the lines with figures (`key=value`) to the terminal.
# Wheels the machine lacks: see ops/gpu_env.sh.
set -uo pipefail
out=${1:?output directory}; rev=${2:?the older commit, written out in .ab_old}; rounds=${3:?rounds}
shift 3; [ "${1:-}" = "--" ] && shift
[ -d .ab_old ] || { echo "no .ab_old: write $rev out there first (git archive $rev | tar -x -C .ab_old)" >&2; exit 2; }
mkdir -p "$out"
source ops/gpu_env.sh
site=""; [[ $PYTHONPATH == /tmp/site:* ]] && site=/tmp/site:  # the wheels, never this tree
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for round in $(seq "$rounds"); do
  for tree in new old; do
    dir=$PWD; [ "$tree" = old ] && dir=$PWD/.ab_old
    echo "== round $round, $tree ($([ "$tree" = old ] && echo "$rev" || git rev-parse --short HEAD 2>/dev/null || echo HEAD))"
    (cd "$dir" && PYTHONPATH="$site$dir" "$@") 2>&1 | tee -a "$out/$tree.log" | grep -E "^[a-z0-9_]+=" | grep -v "^event="
  done
done
