"""Random-weight models of real shapes, for speed and GPU parity checks (never committed: a
0.6B model is 1.2 GB in bfloat16).

Built like the fixtures (make_models.py): mlx_lm's own model class under a fixed seed, projections
scaled and norms perturbed so greedy decoding does not collapse, with the golden tokenizer. The
embedding keeps the real vocabulary size (the head is tied), but the rows of ids the 1024-token
fixture tokenizer lacks are zero, so their logits are 0 and greedy text stays decodable.
Reproducible: the same shape, dtype and seed give the same weights. The mixture-of-experts shape
has Qwen3-30B-A3B's layers (128 experts of width 768, 8 per token) but 4 of its 48, and a tied
head like the dense ones, so a speed row measures the expert layers at a size a bench can load
twice. The hybrid shape has Qwen3.5-0.8B's gated-DeltaNet and gated-attention layers.

    python oracles/make_bench_models.py qwen3-0.6b [--dtype bfloat16] [--bits 4] [--out DIR]

The folder defaults to target/bench-models/<shape>-<dtype>[-<bits>bit].
"""

import common  # noqa: F401  (offline guard first)

import argparse
import copy
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from common import REPO, copy_tokenizer, fresh_dir, log, write_json
from make_models import EOS, VOCAB, quantize_copy, tweak_init

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128,
             rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960,
             rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=True,
             eos_token_id=EOS)
QWEN3_MOE = dict(QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
SHAPES = {
    # Qwen3-0.6B and Qwen3-4B's configs (dense, tied head).
    "qwen3-0.6b": (11, dict(QWEN3, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                            num_attention_heads=16, num_key_value_heads=8)),
    "qwen3-4b": (12, dict(QWEN3, hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                          num_attention_heads=32, num_key_value_heads=8)),
    # Qwen3.5-0.8B's text layers as mlx_lm's qwen3_next builds them without experts (24 layers,
    # every 4th full attention, 8 heads and 2 KV heads of 256, the vocabulary; the DeltaNet's 16
    # key and value heads of 128 and the MLP's 3584 follow Qwen3-Next's per-head dims, unverified).
    "qwen3_5-0.8b": (14, dict(QWEN3, architectures=["Qwen3NextForCausalLM"],
                              model_type="qwen3_next", hidden_size=1024, num_hidden_layers=24,
                              intermediate_size=3584, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=256, vocab_size=248320,
                              rope_theta=10000000.0, partial_rotary_factor=0.25,
                              full_attention_interval=4, linear_num_key_heads=16,
                              linear_num_value_heads=16, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4,
                              num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
                              shared_expert_intermediate_size=0, mlp_only_layers=[],
                              moe_intermediate_size=0)),
    # Qwen3-30B-A3B's layers, 4 of them.
    "qwen3-30b-a3b-l4": (13, dict(QWEN3_MOE, hidden_size=2048, num_hidden_layers=4,
                                  intermediate_size=6144, moe_intermediate_size=768,
                                  num_experts=128, num_experts_per_tok=8,
                                  num_attention_heads=32, num_key_value_heads=4)),
}


def build(shape: str, dtype: str):
    from mlx_lm.utils import _get_classes

    seed, dims = SHAPES[shape]
    cfg = {**dims, "torch_dtype": dtype}
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(copy.deepcopy(cfg)))
    weights = tweak_init(dict(tree_flatten(model.parameters())), seed, one_centred=True)
    embed = weights["model.embed_tokens.weight"]
    known = (mx.arange(embed.shape[0]) < VOCAB)[:, None]
    weights["model.embed_tokens.weight"] = mx.where(known, embed, mx.zeros_like(embed))
    return cfg, {k: v.astype(getattr(mx, dtype)) for k, v in sorted(weights.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--bits", type=int, choices=[4], help="also write a 4-bit copy (mlx_lm convert)")
    ap.add_argument("--out", help="model folder")
    args = ap.parse_args()
    name = f"{args.shape}-{args.dtype}"
    out = fresh_dir(Path(args.out) if args.out else REPO / "target" / "bench-models" / name)
    cfg, weights = build(args.shape, args.dtype)
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", cfg)
    copy_tokenizer(out)
    params = sum(v.size for v in weights.values())
    log(f"{out}: {params / 1e9:.2f}B params, {(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB")
    if args.bits:
        quantize_copy(out, out.with_name(f"{out.name}-4bit"))


if __name__ == "__main__":
    main()
