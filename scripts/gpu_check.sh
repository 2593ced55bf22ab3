#!/usr/bin/env bash
# Run the paged-KV kernel check on a GPU machine (see scripts/gpu_check.py --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/gpu_check.py "$@"
