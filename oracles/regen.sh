#!/usr/bin/env bash
# Regenerates everything under golden/ from the pinned oracle venv, except the trained weights
# (oracles/train.sh): fixtures and SHA256SUMS, the ops golden, and every trace in
# golden/MANIFEST.toml (mlx-lm and mlx-vlm). Deterministic: on a clean checkout `git status` shows no change.
# Usage: bash oracles/venv.sh && bash oracles/regen.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$here/.venv/bin/python"
[ -x "$py" ] || { echo "error: no oracle venv; run: bash oracles/venv.sh" >&2; exit 2; }
unset LD_PRELOAD
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
bash "$here/build_fixtures.sh"
echo "== ops golden"
"$py" "$here/record_ops.py"
echo "== traces"
"$py" "$here/record.py"
echo "== mlx-vlm traces"
"$py" "$here/record_vlm.py"
