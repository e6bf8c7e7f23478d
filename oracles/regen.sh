#!/usr/bin/env bash
# Regenerates everything under golden/ that the pinned oracle venv records on the CPU: fixtures
# and SHA256SUMS, the ops golden, every trace in golden/MANIFEST.toml (mlx-lm and mlx-vlm), mlx-vlm's
# batched MTP rounds (golden/vlm-batch), the acceptance suites with the oracles' own acceptance,
# and the mlx_lm.server exchanges. Not here:
# the trained weights (oracles/train.sh), the CUDA and Metal sets (recorded on those machines;
# docs/goldens.md) and what verity itself measures (acceptance baselines, the MaskBench outcome).
# Deterministic: on a clean checkout `git status` shows no change.
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
echo "== mlx-vlm batched MTP rounds"
"$py" "$here/record_vlm_batch.py"
echo "== acceptance suites"
"$py" "$here/make_accept_suite.py"
echo "== mlx_lm.server exchanges"
"$py" "$here/record_server.py"
