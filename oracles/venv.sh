#!/usr/bin/env bash
# Creates the pinned oracle virtualenv at oracles/.venv (idempotent). Oracle code never reaches
# the network: every script loads local paths only, with HF_HUB_OFFLINE=1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
echo "oracle venv ready: $venv"
