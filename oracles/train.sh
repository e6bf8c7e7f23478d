#!/usr/bin/env bash
# Trains golden/models/qwen3-target and qwen3-draft (train_tiny.py) in parallel, one core each,
# then the DFlash drafters qwen3-target-dflash and qwen3_5-dflash (train_dflash.py; they distil the
# targets' own greedy output, so they run after the target is trained), one after the other, and
# beside them, on the other core, qwen3_5-trained (train_mtp.py: the qwen3_5 text model with its
# native MTP head; it needs nothing trained).
# Reproducible bit for bit: Debian's single-threaded OpenBLAS is preloaded (the wheel's reference
# BLAS is ~15x slower at sgemm) and pinned to one thread. Only the TRAINING uses OpenBLAS; every
# golden output is produced with the stock wheel (docs/fixture-pitfalls.md, P12).
# Usage: oracles/train.sh [STEPS [OUT_ROOT]]   (defaults: 1500, golden/models)
#        oracles/train.sh --dflash-only [STEPS [OUT_ROOT]]  (only the two DFlash drafters, ~14 min, 1 core)
#        oracles/train.sh --mtp-only [STEPS [OUT_ROOT]]     (only qwen3_5-trained, ~20 min, 1 core)
#        oracles/train.sh --bench-pair [STEPS [OUT_ROOT]]   (only the head_dim-64 pair for GPU benches,
#                                                            default OUT_ROOT target/bench-models)
#        oracles/train.sh --deep-pair [STEPS [OUT_ROOT]]    (the 16-layer target-deep, default 600 steps,
#                                                            then draft-hd64 distilled from it, 1500 steps,
#                                                            into target/bench-models; ~35 min, 1 core)
# STEPS is train_tiny.py's step count; the drafters and qwen3_5-trained train their own fixed counts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$here/.venv/bin/python"
blas=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0
[ -x "$py" ] || { echo "error: run oracles/venv.sh first" >&2; exit 2; }
[ -f "$blas" ] || { echo "error: $blas missing (apt-get install libopenblas0-serial)" >&2; exit 2; }
dflash_only=0
mtp_only=0
deep_pair=0
suffix=""
default_root="$here/../golden/models"
case "${1:-}" in
  --dflash-only) dflash_only=1; shift ;;
  --mtp-only) mtp_only=1; shift ;;
  --bench-pair) suffix="-hd64"; default_root="$here/../target/bench-models"; shift ;;
  --deep-pair) deep_pair=1; default_root="$here/../target/bench-models"; shift ;;
esac
steps="${1:-$([ $deep_pair = 1 ] && echo 600 || echo 1500)}"
root="$(realpath -m "${2:-$default_root}")"
export HF_HUB_OFFLINE=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error PYTHONDONTWRITEBYTECODE=1
export HF_HUB_CACHE="$(mktemp -d)"
trap 'rm -rf "$HF_HUB_CACHE"' EXIT
start=$SECONDS
pids=()
status=0
if [ $deep_pair = 1 ]; then
  LD_PRELOAD="$blas" "$py" "$here/train_tiny.py" target-deep --steps "$steps" \
    --out "$root/qwen3-target-deep" 2>&1 | sed -u "s/^/[target-deep] /" || status=1
  if [ $status = 0 ]; then
    LD_PRELOAD="$blas" "$py" "$here/train_tiny.py" draft-hd64 --distil-from "$root/qwen3-target-deep" \
      --out "$root/qwen3-draft-deep" 2>&1 | sed -u "s/^/[draft-deep] /" || status=1
  fi
  echo "training finished in $((SECONDS - start)) s (status $status)"
  exit $status
fi
if [ $dflash_only = 0 ] && [ $mtp_only = 0 ]; then
  for which in target draft; do
    LD_PRELOAD="$blas" "$py" "$here/train_tiny.py" "$which$suffix" --steps "$steps" \
      --out "$root/qwen3-$which$suffix" > >(sed -u "s/^/[$which$suffix] /") 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
fi
if [ -n "$suffix" ]; then
  echo "training finished in $((SECONDS - start)) s (status $status)"
  exit $status
fi
# train_mtp.py takes its config and vision tower from the committed golden/models/qwen3_5 whatever
# OUT_ROOT is; it runs in the background, beside the drafters.
mtp_pid=
if [ $status = 0 ] && [ $dflash_only = 0 ]; then
  LD_PRELOAD="$blas" "$py" "$here/train_mtp.py" --out "$root/qwen3_5-trained" \
    > >(sed -u "s/^/[qwen3_5-trained] /") 2>&1 &
  mtp_pid=$!
fi
# The drafters read their targets from golden/models (train_dflash.py); with another OUT_ROOT
# they are written there but still distil the committed targets.
if [ $status = 0 ] && [ $mtp_only = 0 ]; then
  for target in qwen3-target qwen3_5; do
    LD_PRELOAD="$blas" "$py" "$here/train_dflash.py" "$target" \
      --out "$root/$target-dflash" 2>&1 | sed -u "s/^/[$target-dflash] /" || status=1
  done
fi
if [ -n "$mtp_pid" ]; then wait "$mtp_pid" || status=1; fi
echo "training finished in $((SECONDS - start)) s (status $status)"
exit $status
