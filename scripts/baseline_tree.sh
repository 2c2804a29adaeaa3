#!/usr/bin/env bash
# A baseline beside a device run: the project's code at REV (default HEAD) as .baseline/, for the `device`
# tool's `carry` (ignored by git, ~4 MB). bench/gpu_check.sh prefill runs the same benchmark there first when
# PREFILL_BASELINE=.baseline, so one call compares two builds on one machine (hosts differ between calls).
#   bash scripts/baseline_tree.sh e47f162    # then carry [".whl", ".baseline"]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
rm -rf .baseline
mkdir .baseline
git archive "$rev" libs bench | tar -x -C .baseline
echo "$(git rev-parse --short "$rev")" > .baseline/REV
echo ".baseline: libs/ and bench/ at $(cat .baseline/REV) ($(du -sh .baseline | cut -f1))"
