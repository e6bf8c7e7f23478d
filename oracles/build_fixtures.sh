#!/usr/bin/env bash
# Rebuilds every fixture except the trained weights, byte-identically, then checks and hashes them:
#   tokenizer -> random fixtures (+4-bit) -> derived copies of the trained models -> the trained
#   MTP head split out (mlx-vlm's splitter) -> smoke check
#   -> golden/models/SHA256SUMS.
# On a clean checkout `git status` stays unchanged. Oracle code never reaches the network.
# Usage: oracles/build_fixtures.sh [--no-check]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
golden="$(realpath "$here/../golden")"
check=1
[ "${1:-}" = "--no-check" ] && check=0
bash "$here/venv.sh" >/dev/null
py="$here/.venv/bin/python"
unset LD_PRELOAD  # goldens come from the stock wheel's BLAS only (docs/fixture-pitfalls.md, P12)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
export TRANSFORMERS_VERBOSITY=error
export HF_HUB_CACHE="$(mktemp -d)"
trap 'rm -rf "$HF_HUB_CACHE"' EXIT
for m in qwen3-target qwen3-draft; do
  [ -f "$golden/models/$m/model.safetensors" ] || { echo "error: $golden/models/$m missing (train with oracles/train.sh)" >&2; exit 2; }
done
start=$SECONDS
step() { echo "== $1"; shift; "$py" "$@"; }
step "tokenizer"          "$here/make_tokenizer.py"
step "random fixtures"    "$here/make_models.py"
step "derived fixtures"   "$here/derive_trained.py"
step "split MTP drafter"  "$here/split_mtp.py"
[ $check = 1 ] && step "smoke check" "$here/check_fixtures.py"
step "SHA256SUMS"         "$here/hash_goldens.py"
echo "== done in $((SECONDS - start)) s; golden/models + golden/tokenizer: $(du -sh "$golden/models" "$golden/tokenizer" | awk '{print $1}' | paste -sd+); golden/: $(du -sh "$golden" | cut -f1)"
