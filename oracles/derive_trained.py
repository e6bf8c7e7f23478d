"""Fixtures derived from the committed trained models: 4-bit copies and noisy copies of the target.

Why noisy copies: a draft that is the target plus seeded Gaussian noise gives a tunable speculative
acceptance rate without any training (sigma 0.1 / 0.3 / 1.0: high / medium / near-zero acceptance).
Method, per tensor of qwen3-target (sorted by name, one PRNG split per tensor):
    w' = w + sigma * std(w) * N(0, 1)      (float32; std = population std over the whole tensor)
with the MLX key mx.random.key(NOISE_SEEDS[sigma]). Each folder records this in derivation.json.

The noisy copies' weights are derived, not shipped (golden/ has a size budget; they are 11 MB of
bytes any checkout recomputes in a second): golden/models/<name>/ holds config.json, the tokenizer
files and derivation.json, and `materialise` writes the loadable copy with the weights to
target/derived-models/<name>/, where verity materialises the same bytes with its own MLX binding
(src/parity/derived.rs). golden/models/SHA256SUMS keeps the weights' hash (hash_goldens.py).
Everything here is rebuilt byte-identically by build_fixtures.sh from the trained weights alone.

Usage: derive_trained.py
"""

import common  # noqa: F401  (offline guard first)

import os
import shutil
from pathlib import Path

import mlx.core as mx

from common import DERIVED, MODELS, copy_tokenizer, die, fresh_dir, log, model_dir, read_json, write_json
from make_models import quantize_copy

NOISE_SEEDS = {0.1: 101, 0.3: 103, 1.0: 110}
# verity refuses a derivation.json with another method (src/parity/derived.rs).
NOISE_METHOD = ("per tensor, sorted by name: w + sigma*std(w)*N(0,1), "
                "key = mx.random.split chain from mx.random.key(seed)")


def noisy_weights(src: Path, sigma: float, seed: int) -> dict:
    weights = mx.load(str(src / "model.safetensors"))
    key = mx.random.key(seed)
    out_w = {}
    for name in sorted(weights):
        w = weights[name]
        key, sub = mx.random.split(key)
        out_w[name] = (w + sigma * mx.std(w) * mx.random.normal(w.shape, key=sub)).astype(w.dtype)
    mx.eval(list(out_w.values()))
    return out_w


def noisy_copy(src_name: str, sigma: float) -> None:
    """The golden folder of a noisy copy (no weights), and its materialised copy."""
    src = model_dir(src_name)
    dst = fresh_dir(MODELS / f"{src_name}-noise{sigma}")
    write_json(dst / "config.json", read_json(src / "config.json"))
    copy_tokenizer(dst)
    write_json(dst / "derivation.json", {
        "source": src_name, "sigma": sigma, "seed": NOISE_SEEDS[sigma], "method": NOISE_METHOD,
    })
    materialise(dst)
    log(f"{dst.name}: sigma {sigma}")


def materialise(folder: Path) -> Path:
    """DERIVED/<name>/: the derived folder's files and the weights its derivation.json describes.
    Every file is written through a temporary one and a rename: verity (or another oracle) may be
    reading or writing the same copy."""
    spec = read_json(folder / "derivation.json")
    if spec.get("method") != NOISE_METHOD:
        die(f"{folder / 'derivation.json'}: unknown method {spec.get('method')!r}")
    out = DERIVED / folder.name
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{os.getpid()}.model.safetensors"  # MLX appends .safetensors to any other name
    try:
        for f in folder.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp)
                os.replace(tmp, out / f.name)
        weights = noisy_weights(MODELS / spec["source"], spec["sigma"], spec["seed"])
        mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
        os.replace(tmp, out / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main():
    for name in ("qwen3-target", "qwen3-draft"):
        quantize_copy(model_dir(name), MODELS / f"{name}-4bit")
    for sigma in NOISE_SEEDS:
        noisy_copy("qwen3-target", sigma)


if __name__ == "__main__":
    main()
