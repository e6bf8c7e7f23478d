"""Write (or --check) golden/models/SHA256SUMS: sha256 of every file under golden/models and
golden/tokenizer, paths relative to golden/, sorted by path, in `sha256sum -c` format (run it from
golden/). Why: one small file that shows in a diff whenever any fixture byte changes.
A derived folder's weights are not shipped (derive_trained.py): their line, under the path they
would have in golden/, is the hash of the copy rebuilt now under target/derived-models, which verity
checks its own materialised copy against (so `sha256sum -c` needs --ignore-missing).

Usage: hash_goldens.py [--check]
"""

import argparse
import hashlib
import sys

from common import GOLDEN, MODELS, TOKENIZER, die, loadable, log, write_text

SUMS = MODELS / "SHA256SUMS"


def digest_lines() -> list[str]:
    files = sorted(p for root in (MODELS, TOKENIZER) for p in root.rglob("*")
                   if p.is_file() and p != SUMS and "__pycache__" not in p.parts)
    if not files:
        die(f"nothing to hash under {GOLDEN}")
    rows = [(p.relative_to(GOLDEN).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest()) for p in files]
    for folder in sorted(p.parent for p in MODELS.glob("*/derivation.json")):
        weights = loadable(folder) / "model.safetensors"
        rows.append(((folder / weights.name).relative_to(GOLDEN).as_posix(),
                     hashlib.sha256(weights.read_bytes()).hexdigest()))
    return [f"{h}  {rel}" for rel, h in sorted(rows)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on mismatch")
    args = ap.parse_args()
    text = "\n".join(digest_lines()) + "\n"
    if args.check:
        old = SUMS.read_text() if SUMS.is_file() else ""
        if old != text:
            log(f"{SUMS} is out of date")
            sys.exit(1)
        log(f"{SUMS} matches ({text.count(chr(10))} files)")
        return
    write_text(SUMS, text)
    total = sum(p.stat().st_size for root in (MODELS, TOKENIZER) for p in root.rglob("*") if p.is_file())
    log(f"wrote {SUMS.relative_to(GOLDEN.parent)}: {text.count(chr(10))} files, golden total {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
