"""Split a Qwen3.5 fixture into a target without its MTP head and a drafter folder holding it,
as a user of a community conversion (which strips `mtp.*`) would pair them with mlx-vlm.

The drafter folder is written by mlx-vlm's own splitter, Qwen3_5MTPSplitter.split
(mlx_vlm/speculative/drafters/qwen3_5_mtp/split.py, mechanics in mtp_split.py): the `mtp.*`
tensors with the prefix dropped and their zero-centred norms shifted by +1, saved with
metadata format "mlx"; config.json = {block_size, model_type "qwen3_5_mtp", text_config (the
source's, whole), tie_word_embeddings}; the tokenizer files copied. mlx-vlm has no target-side
helper: --target writes the source folder minus its `mtp.*` tensors (metadata kept), the shape
of a stripped conversion.

Only the drafter of the trained fixture is committed (golden/models/qwen3_5-trained-mtp, ~0.8
MB): the stripped target would add 4.1 MB to golden/, whose budget tests/fixtures.rs holds, and
verity ignores a target's own head when --draft-mtp names a folder, so the tests pair the split
head with qwen3_5-trained itself (and with qwen3_5-4bit, a conversion without `mtp.*`).

Usage: split_mtp.py [--source NAME] [--drafter DIR] [--target DIR]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter

from common import MODELS, fresh_dir, log, model_dir


def strip_target(src: Path, out: Path) -> None:
    """`src` without its `mtp.*` tensors; every other file copied as it is."""
    out = fresh_dir(out)
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
            continue
        weights, metadata = mx.load(str(f), return_metadata=True)
        kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        mx.save_safetensors(str(out / f.name), kept, metadata=metadata)
    log(f"{out.name}: target without mtp.* tensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default="qwen3_5-trained", help="fixture under golden/models")
    ap.add_argument("--drafter", type=Path, default=None,
                    help="drafter folder (default golden/models/SOURCE-mtp)")
    ap.add_argument("--target", type=Path, default=None, help="also write the stripped target here")
    args = ap.parse_args()
    src = model_dir(args.source)
    drafter = fresh_dir(args.drafter or MODELS / f"{args.source}-mtp")
    Qwen3_5MTPSplitter().split(str(src), str(drafter))
    log(f"{drafter.name}: mlx-vlm's split of {args.source}'s MTP head")
    if args.target is not None:
        strip_target(src, args.target)


if __name__ == "__main__":
    main()
