"""Fixtures derived from the committed trained models: 4-bit copies and noisy copies of the target.

Why noisy copies: a draft that is the target plus seeded Gaussian noise gives a tunable speculative
acceptance rate without any training (sigma 0.1 / 0.3 / 1.0: high / medium / near-zero acceptance).
Method, per tensor of qwen3-target (sorted by name, one PRNG split per tensor):
    w' = w + sigma * std(w) * N(0, 1)      (float32; std = population std over the whole tensor)
with the MLX key mx.random.key(NOISE_SEEDS[sigma]). Each folder records this in derivation.json.
Everything here is rebuilt byte-identically by build_fixtures.sh from the trained weights alone.

Usage: derive_trained.py
"""

import common  # noqa: F401  (offline guard first)

import mlx.core as mx

from common import MODELS, copy_tokenizer, fresh_dir, log, model_dir, read_json, write_json
from make_models import quantize_copy

NOISE_SEEDS = {0.1: 101, 0.3: 103, 1.0: 110}


def noisy_copy(src_name: str, sigma: float) -> None:
    src = model_dir(src_name)
    weights = mx.load(str(src / "model.safetensors"))
    key = mx.random.key(NOISE_SEEDS[sigma])
    out_w = {}
    for name in sorted(weights):
        w = weights[name]
        key, sub = mx.random.split(key)
        out_w[name] = (w + sigma * mx.std(w) * mx.random.normal(w.shape, key=sub)).astype(w.dtype)
    mx.eval(list(out_w.values()))
    dst = fresh_dir(MODELS / f"{src_name}-noise{sigma}")
    mx.save_safetensors(str(dst / "model.safetensors"), out_w, metadata={"format": "mlx"})
    write_json(dst / "config.json", read_json(src / "config.json"))
    copy_tokenizer(dst)
    write_json(dst / "derivation.json", {
        "source": src_name, "sigma": sigma, "seed": NOISE_SEEDS[sigma],
        "method": "per tensor, sorted by name: w + sigma*std(w)*N(0,1), "
                  "key = mx.random.split chain from mx.random.key(seed)",
    })
    log(f"{dst.name}: sigma {sigma}")


def main():
    for name in ("qwen3-target", "qwen3-draft"):
        quantize_copy(model_dir(name), MODELS / f"{name}-4bit")
    for sigma in NOISE_SEEDS:
        noisy_copy("qwen3-target", sigma)


if __name__ == "__main__":
    main()
