"""Random-weight fixture models (seeded, float32) and their 4-bit copies, built with the oracles' code.

Why random: they exercise architecture, cache, quantization and loading plumbing in milliseconds and
rebuild byte-identically anywhere (no training). Every model is instantiated from mlx_lm's own model
class (mlx_lm.utils._get_classes) under a fixed per-model seed, so the weights are exactly what the
oracle's initialisers produce, then tweaked so greedy decoding does not collapse onto one token
(docs/fixture-pitfalls.md, P13): embeddings are untied; every 2-D projection is scaled by 2 (MLX's
uniform(+-1/sqrt(in)) init is so contractive that the residual stream settles into a loop); every
norm weight gets an effective scale of 1 + 0.1*N(0,1) (stored as 0.1*N for Gemma's (1+w) norms and
Qwen3.5's zero-centred HF norms), which also makes a "1+w vs w" convention bug visible.

qwen3_5 is written in full Hugging Face layout (model.language_model.*, conv1d as (C,1,K),
zero-centred norms, a tiny vision tower, an mtp.* head) so that mlx-lm, mlx-vlm and the MTP drafter
all read it the way they read a real Qwen3.5 checkpoint (P14, P16). Its safetensors metadata says
format "pt", like a real HF checkpoint: mlx-vlm's MTP splitter treats a "format":"mlx" file as
already sanitized and would then skip the +1 shift of the zero-centred mtp.* norms
(mlx_vlm/speculative/drafters/mtp_split.py, MTPSplitter.transform).

4-bit copies go through mlx_lm's convert (affine, 4 bits, group 64); the golden tokenizer files are
then copied back over the ones convert re-saves (P2), and convert's README.md (it embeds the
absolute source path) is dropped.

qwen3_moe is written in Hugging Face layout too, one tensor per expert
(model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight), so that mlx-lm's sanitize (which stacks
them into switch_mlp.*) runs on it; its expert weights get the same x2 gain as the 2-D projections.
Its -4bit copy keeps mlx-lm's own quant_predicate (the router gate at 8 bits, group 64) and puts the
experts of its last MoE layer at 8 bits as well (QWEN3_MOE_8BIT), so one small folder has 4-bit and
8-bit gather_qmm experts.

qwen3_5_moe is a text-only Qwen3.5-MoE checkpoint in Hugging Face layout (model.language_model.*,
conv1d as (C,1,K), zero-centred norms, each layer's experts fused as mlp.experts.gate_up_proj
(E, 2I, H) and mlp.experts.down_proj (E, H, I)), so that mlx-lm's qwen3_5_moe sanitize splits
them; no vision tower and no mtp.* head (mlx-lm drops it), to stay small. Its -4bit copy uses
mlx-lm's own quant_predicate (router and shared-expert gates at 8 bits, group 64).

glm4_moe is written in Hugging Face layout like qwen3_moe (one tensor per expert, which mlx-lm's
sanitize stacks), plus a model.layers.<num_hidden_layers>.* multi-token-prediction layer that its
sanitize drops. Its router weights and e_score_correction_bias are drawn at random (mlx-lm initialises
MoEGate's to zeros: every token would pick the same experts, and the bias path would go untested). Its -4bit copy uses mlx-lm's default predicate: MoEGate is no
nn.Linear so the router stays f32, and the projections whose input is not a multiple of 64 (the
experts' and MLPs' down_proj, o_proj) stay f32 beside 4-bit ones. head_dim 16 keeps it small (the
untied lm_head doubles the vocabulary's share), so no KV-quantized cases run on it.

Usage: make_models.py [NAME ...] [--no-quant]      (default: all random fixtures)
"""

import common  # noqa: F401  (offline guard first)

import argparse
import copy
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from common import MODELS, copy_tokenizer, die, fresh_dir, log, write_json

VOCAB = 1024
EOS = [2, 0]  # <|im_end|>, <|endoftext|>
NORM_SIGMA = 0.1
LINEAR_GAIN = 2.0  # measured: with gain 1 random llama repeats one token, with 2 no fixture does

_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, num_hidden_layers=2,
    intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=10000.0,
    attention_bias=False, mlp_bias=False, tie_word_embeddings=False, eos_token_id=EOS,
)
_LINEAR_ATTN = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
_QWEN35_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, **_LINEAR_ATTN,
    rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=4096, attention_bias=False,
    tie_word_embeddings=False, hidden_act="silu", dtype="float32",
    rope_parameters=dict(rope_type="default", type="default", rope_theta=100000.0,
                         partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
    mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, eos_token_id=EOS,
)
_QWEN35_VISION = dict(
    model_type="qwen3_5", depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
    in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
    out_hidden_size=128, num_position_embeddings=64, deepstack_visual_indexes=[],
    hidden_act="gelu_pytorch_tanh",
)

# Three layers: MoE, dense (mlp_only_layers), MoE; 8 experts, 2 per token, renormalised.
_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
    num_hidden_layers=3, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
    moe_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=VOCAB,
    max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=EOS,
)
# Two layers, gated DeltaNet then full attention, each with 4 experts (top 2, not renormalised,
# the branch qwen3_moe leaves out) and a shared expert.
_QWEN35_MOE_TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_value_heads=2,
    linear_num_key_heads=1, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, full_attention_interval=2,
    layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    norm_topk_prob=False, rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=4096,
    attention_bias=False, tie_word_embeddings=True, hidden_act="silu", dtype="float32",
    rope_parameters=dict(rope_type="default", type="default", rope_theta=100000.0,
                         partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
    eos_token_id=EOS,
)
# Two layers, dense then MoE (first_k_dense_replace 1): 8 experts in 4 groups of 2, the best 2
# groups eligible (topk_group < n_group), top 3 renormalised and scaled by 2.5, one shared expert;
# q/k/v biases, per-head q/k norms, RoPE on half of each head. Small: golden/ is near its limit.
_GLM4_MOE = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=64,
    num_hidden_layers=2, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, first_k_dense_replace=1, partial_rotary_factor=0.5,
    use_qk_norm=True, attention_bias=True, rope_theta=1000000.0, rope_scaling=None,
    rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=4096, scoring_func="sigmoid",
    topk_method="noaux_tc", tie_word_embeddings=False, eos_token_id=EOS,
)
# GLM-4.7-Flash's shape, small: MLA attention (q through a rank-64 LoRA with its norm, a 64-wide
# latent KV plus 16 RoPE'd dims shared by both heads, traditional RoPE; nope and latent widths 64
# so the -4bit copy quantizes embed_q and unembed_out, the transposed and the plain product),
# biases on q_a / kv_a / o; a dense layer then a MoE one: 8 experts ungrouped (n_group 1, the
# branch glm4_moe leaves out), top 3 renormalised x1.8, a shared expert; expert 5 of the MoE layer
# has a correction bias of -10, so no token ever picks it.
_GLM4_MOE_LITE = dict(
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", hidden_size=64,
    num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.8, first_k_dense_replace=1, moe_layer_freq=1, attention_bias=True,
    rope_theta=1000000.0, rope_scaling=None, partial_rotary_factor=1.0, rms_norm_eps=1e-5,
    vocab_size=VOCAB, max_position_embeddings=4096, scoring_func="sigmoid", topk_method="noaux_tc",
    tie_word_embeddings=False, num_nextn_predict_layers=1, eos_token_id=EOS,
)
GLM_LITE_DEAD_EXPERT = 5
# Five layers, sliding/full/sliding then two KV-shared ones (a sliding layer reading layer 2's
# cache, a full one reading layer 1's, both with double-wide GeGLU MLPs); full layers 64 wide
# with keys as values (attention_k_eq_v, two global KV heads) and proportional RoPE on a quarter
# of each head, sliding ones 32 wide over a 16-token window; per-layer inputs 8 wide (their
# projections, like the MLPs' down_proj, stay f32 in the -4bit copy: inputs below 64); tied
# embeddings and soft-capped logits. No MoE block (gemma4_moe below has one).
_GEMMA4 = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=64,
    num_hidden_layers=5, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, global_head_dim=64, num_global_key_value_heads=2, attention_k_eq_v=True,
    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention"],
    rope_parameters=dict(
        full_attention=dict(partial_rotary_factor=0.25, rope_theta=1000000.0,
                            rope_type="proportional"),
        sliding_attention=dict(partial_rotary_factor=1.0, rope_theta=10000.0,
                               rope_type="default")),
    final_logit_softcapping=30.0, use_double_wide_mlp=True, enable_moe_block=False,
    rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
    eos_token_id=EOS,
)
# Gemma 4's MoE variant, small: three layers (sliding, full, then a sliding one reading layer
# 0's cache), each with its MLP beside a block of 4 GeGLU experts (top 2, random router scales);
# no per-layer inputs and no double-wide MLPs (the branches the dense fixture leaves out). Its
# -4bit copy keeps mlx-lm's quant_predicate (the router projections at 8 bits).
_GEMMA4_MOE = {
    **_GEMMA4, "num_hidden_layers": 3, "num_kv_shared_layers": 1,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False, "enable_moe_block": True,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
}
# The experts the -4bit copy quantizes at 8 bits (besides mlx-lm's router gates): layer 2's.
QWEN3_MOE_8BIT = "model.layers.2.mlp.switch_mlp."

# name -> (seed, config). Every dimension a quantized Linear sees as input is a multiple of 64
# (P11) and head_dim 32 is divisible by kv_group_size 32.
SPECS = {
    "llama": (1, _LLAMA),
    "llama-draft": (2, {**_LLAMA, "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
                        "num_attention_heads": 2, "num_key_value_heads": 1}),
    "qwen3": (3, {**_LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}),
    "gemma3": (4, dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=128,
        num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=16, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=None, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=4096, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=False, eos_token_id=EOS)),
    "qwen3_next": (5, dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=128,
        num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, **_LINEAR_ATTN, num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
        shared_expert_intermediate_size=0, moe_intermediate_size=0, mlp_only_layers=[],
        norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=4096,
        rope_theta=1000000.0, partial_rotary_factor=0.25, attention_bias=False,
        tie_word_embeddings=False, eos_token_id=EOS)),
    "qwen3_5": (6, dict(
        architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
        text_config=_QWEN35_TEXT, vision_config=_QWEN35_VISION, image_token_id=248056,
        video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054,
        tie_word_embeddings=False, eos_token_id=EOS)),
    "qwen3_moe": (7, _QWEN3_MOE),
    "qwen3_5_moe": (8, dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
        text_config=_QWEN35_MOE_TEXT, tie_word_embeddings=True, eos_token_id=EOS)),
    "glm4_moe": (9, _GLM4_MOE),
    "gemma4": (10, _GEMMA4),
    "gemma4_moe": (11, _GEMMA4_MOE),
    "glm4_moe_lite": (12, _GLM4_MOE_LITE),
}

# Norm weights that HF stores zero-centred and the oracles shift by +1 when loading a Qwen3.5 HF
# checkpoint. The gated linear_attn.norm is not among them (HF stores it one-centred); in mtp.*
# every norm is zero-centred. Same suffix logic as mlx_lm qwen3_5 sanitize / mlx_vlm
# NORM_WEIGHT_SUFFIXES / _QWEN_MTP_NORM_SUFFIXES.
QWEN35_TEXT_SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                       "language_model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def hf_zero_centred(key: str) -> bool:
    if key.startswith("mtp."):
        return is_norm(key)
    return key.endswith(QWEN35_TEXT_SHIFTED)


def is_norm(key: str) -> bool:
    """RMSNorm weights (input_layernorm, q_norm, linear_attn.norm, pre_fc_norm_hidden, ...)."""
    *_, module, leaf = key.split(".")
    return leaf == "weight" and "norm" in module and ".visual." not in key


def tweak_init(weights: dict, seed: int, one_centred: bool) -> dict:
    """Projections scaled by LINEAR_GAIN; norm weights with effective scale 1 + 0.1*N(0,1), stored as
    0.1*N when not one-centred."""
    key = mx.random.key(10_000 + seed)
    out = {k: v * LINEAR_GAIN if v.ndim == 2 and "embed" not in k and ".visual." not in k else v
           for k, v in weights.items()}
    for name in sorted(k for k in weights if is_norm(k)):
        key, sub = mx.random.split(key)
        noise = NORM_SIGMA * mx.random.normal(weights[name].shape, key=sub)
        out[name] = (1.0 + noise) if one_centred else noise
    return out


def build_mlx_lm(cfg: dict, seed: int) -> dict:
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(copy.deepcopy(cfg)))
    weights = dict(tree_flatten(model.parameters()))
    if cfg.get("tie_word_embeddings") is False and not any(k.endswith("lm_head.weight") for k in weights):
        die(f"{cfg['model_type']}: tie_word_embeddings=false but the model has no lm_head")
    # Only gemma3's norms scale by (1 + w); gemma4's are plain nn.RMSNorm.
    out = tweak_init(weights, seed, one_centred=cfg["model_type"] != "gemma3_text")
    # gemma4's per-layer scalars and router scales (ones at init) around 1 as well, so that a
    # skipped one shows.
    key = mx.random.key(20_000 + seed)
    scales = (".layer_scalar", ".router.scale", ".router.per_expert_scale")
    for name in sorted(k for k in out if k.endswith(scales)):
        key, sub = mx.random.split(key)
        out[name] = 1.0 + NORM_SIGMA * mx.random.normal(out[name].shape, key=sub)
    return out


def build_qwen3_5_hf(cfg: dict, seed: int) -> dict:
    """Text model from mlx_lm, vision tower and MTP head from mlx_vlm, mapped to HF names/layouts."""
    from mlx_lm.models import qwen3_5 as lm_qwen35
    from mlx_vlm.models.qwen3_5.config import VisionConfig
    from mlx_vlm.models.qwen3_5.vision import VisionModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    mx.random.seed(seed)
    text = lm_qwen35.Model(lm_qwen35.ModelArgs.from_dict(copy.deepcopy(cfg)))
    mx.random.seed(seed + 100)
    vision = VisionModel(VisionConfig.from_dict(copy.deepcopy(cfg["vision_config"])))
    mx.random.seed(seed + 200)
    mtp = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": copy.deepcopy(cfg["text_config"])}))

    weights = {}
    for k, v in tree_flatten(text.parameters()):
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k == "language_model.lm_head.weight":
            k = "lm_head.weight"
        else:
            die(f"unexpected qwen3_5 text parameter {k}")
        weights[k] = v
    weights.update({"model.visual." + k: v for k, v in tree_flatten(vision.parameters())})
    weights.update({"mtp." + k: v for k, v in tree_flatten(mtp.parameters())})

    weights = tweak_init(weights, seed, one_centred=True)
    for k, v in weights.items():
        if k.endswith("conv1d.weight"):  # MLX (C, K, 1) -> PyTorch (C, 1, K)
            weights[k] = v.moveaxis(2, 1)
        elif k.endswith("patch_embed.proj.weight"):  # MLX (O, T, H, W, C) -> PyTorch (O, C, T, H, W)
            weights[k] = v.transpose(0, 4, 1, 2, 3)
        elif hf_zero_centred(k):
            weights[k] = v - 1.0  # zero-centred, as HF stores Qwen3_5RMSNorm
    return weights


def build_qwen3_moe_hf(cfg: dict, seed: int) -> dict:
    """mlx_lm's qwen3_moe under the usual tweaks, its stacked experts scaled like the 2-D
    projections and split into the per-expert tensors of a Hugging Face checkpoint."""
    weights = build_mlx_lm(cfg, seed)
    out = {}
    for k, v in weights.items():
        stem, sep, proj = k.rpartition(".mlp.switch_mlp.")
        if not sep:
            out[k] = v
            continue
        v = v * LINEAR_GAIN
        name = proj.removesuffix(".weight")
        for e in range(v.shape[0]):
            out[f"{stem}.mlp.experts.{e}.{name}.weight"] = v[e]
    return out


def build_qwen3_5_moe_hf(cfg: dict, seed: int) -> dict:
    """mlx_lm's qwen3_5_moe under the usual tweaks (experts scaled like the 2-D projections),
    mapped to HF names and layouts."""
    weights = build_mlx_lm(cfg, seed)
    out = {}
    for k, v in weights.items():
        if not k.startswith("language_model.model."):
            die(f"unexpected qwen3_5_moe parameter {k}")
        k = "model.language_model." + k[len("language_model.model."):]
        stem, sep, proj = k.rpartition(".mlp.switch_mlp.")
        if sep:
            out[f"{stem}.mlp.switch_mlp.{proj}"] = v * LINEAR_GAIN
            continue
        if k.endswith("conv1d.weight"):  # MLX (C, K, 1) -> PyTorch (C, 1, K)
            v = v.moveaxis(2, 1)
        elif k.endswith(QWEN35_TEXT_SHIFTED):
            v = v - 1.0  # zero-centred, as HF stores Qwen3_5RMSNorm
        out[k] = v
    for stem in sorted({k.rpartition(".switch_mlp.")[0] for k in out if ".switch_mlp." in k}):
        gate, up, down = (out.pop(f"{stem}.switch_mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        out[f"{stem}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[f"{stem}.experts.down_proj"] = down
    return out


def build_glm4_moe_hf(cfg: dict, seed: int) -> dict:
    """mlx_lm's glm4_moe under the usual tweaks, experts split per expert like qwen3_moe's, random
    router weights and e_score_correction_bias (mlx-lm initialises both to zeros, which would route
    every token alike), and a copy of the
    last layer's input norm as the MTP layer model.layers.<num_hidden_layers> for sanitize to drop."""
    out = build_qwen3_moe_hf(cfg, seed)
    key = mx.random.key(20_000 + seed)
    for k in sorted(k for k in out if k.endswith((".mlp.gate.weight", ".e_score_correction_bias"))):
        key, sub = mx.random.split(key)
        if k.endswith(".weight"):  # like an nn.Linear's init under LINEAR_GAIN
            bound = LINEAR_GAIN / out[k].shape[-1] ** 0.5
            out[k] = mx.random.uniform(-bound, bound, out[k].shape, key=sub)
        else:
            out[k] = 0.1 * mx.random.normal(out[k].shape, key=sub)
    last, mtp = f"model.layers.{cfg['num_hidden_layers'] - 1}.", f"model.layers.{cfg['num_hidden_layers']}."
    out[mtp + "input_layernorm.weight"] = out[last + "input_layernorm.weight"]
    return out


def build_glm4_moe_lite_hf(cfg: dict, seed: int) -> dict:
    """glm4_moe's HF layout (per-expert tensors, random router and correction bias, an MTP layer to
    drop) with each layer's embed_q / unembed_out (scaled like the projections) joined back into
    the HF kv_b_proj that mlx-lm's sanitize splits, and GLM_LITE_DEAD_EXPERT's bias at -10."""
    out = build_glm4_moe_hf(cfg, seed)
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    for stem in sorted({k.rpartition(".embed_q.")[0] for k in out if ".embed_q." in k}):
        wk = out.pop(f"{stem}.embed_q.weight") * LINEAR_GAIN  # (heads, kv_lora, nope)
        wv = out.pop(f"{stem}.unembed_out.weight") * LINEAR_GAIN  # (heads, v_head, kv_lora)
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        out[f"{stem}.kv_b_proj.weight"] = kv_b.reshape(heads * (nope + cfg["v_head_dim"]), -1)
    for k in sorted(k for k in out if k.endswith(".e_score_correction_bias")):
        out[k] = out[k].at[GLM_LITE_DEAD_EXPERT].add(-10.0)
    return out


def glm_lite_kv_b_quantized(dst: Path, layer: int) -> None:
    """In the -4bit copy, layer `layer`'s embed_q / unembed_out (as convert quantized them) joined
    back into a 4-bit kv_b_proj, as a quantized HF-layout checkpoint stores it: mlx-lm's sanitize
    then dequantizes it and requantizes the two halves, with the bits and group size it infers
    from the packing. The other layer keeps convert's own layout, so both load paths run."""
    path = dst / "model.safetensors"
    weights, metadata = mx.load(str(path), return_metadata=True)
    prefix = f"model.layers.{layer}.self_attn"
    q = json.loads((dst / "config.json").read_text())["quantization"]
    half = {}
    for name in ("embed_q", "unembed_out"):
        w, scales, biases = (weights.pop(f"{prefix}.{name}.{k}") for k in ("weight", "scales", "biases"))
        half[name] = mx.dequantize(w, scales, biases, group_size=q["group_size"], bits=q["bits"])
    kv_b = mx.concatenate([half["embed_q"].swapaxes(-1, -2), half["unembed_out"]], axis=1)
    kv_b = kv_b.reshape(-1, kv_b.shape[-1])
    packed = mx.quantize(kv_b, group_size=q["group_size"], bits=q["bits"])
    for k, v in zip(("weight", "scales", "biases"), packed):
        weights[f"{prefix}.kv_b_proj.{k}"] = v
    weights = {k: weights[k] for k in sorted(weights)}
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(path), weights, metadata=metadata)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = sum(v.nbytes for v in weights.values())
    index["weight_map"] = {k: "model.safetensors" for k in weights}
    write_json(dst / "model.safetensors.index.json", index)


def qwen3_moe_predicate(path, module, config=None):
    """mlx-lm's qwen3_moe quant_predicate (router gates at 8 bits, group 64) plus the experts of
    the QWEN3_MOE_8BIT layer at 8 bits; everything else at the convert's 4 bits."""
    if path.endswith(".mlp.gate") or path.startswith(QWEN3_MOE_8BIT):
        return {"group_size": 64, "bits": 8}
    return True


def save(name: str, cfg: dict, weights: dict, fmt: str = "mlx") -> Path:
    out = fresh_dir(MODELS / name)
    weights = {k: weights[k].astype(mx.float32) if mx.issubdtype(weights[k].dtype, mx.floating)
               else weights[k] for k in sorted(weights)}
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": fmt})
    write_json(out / "config.json", cfg)
    copy_tokenizer(out)
    n = sum(v.size for v in weights.values())
    log(f"{name}: {n / 1e3:.0f}k params, {(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB")
    return out


def quantize_copy(src: Path, dst: Path, quant_predicate=None) -> Path:
    """mlx_lm convert -q --q-bits 4 --q-group-size 64 (affine), then restore the tokenizer files.
    `quant_predicate` replaces the model class's own (mlx_lm.convert's argument)."""
    from mlx_lm.convert import convert

    if dst.exists():
        shutil.rmtree(dst)
    convert(hf_path=str(src), mlx_path=str(dst), quantize=True, q_group_size=64, q_bits=4,
            q_mode="affine", quant_predicate=quant_predicate)
    (dst / "README.md").unlink(missing_ok=True)  # model card with the absolute source path
    for p in dst.iterdir():
        if p.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            p.unlink()
    copy_tokenizer(dst)
    log(f"{dst.name}: {(dst / 'model.safetensors').stat().st_size / 1e6:.2f} MB")
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"subset of {list(SPECS)}")
    ap.add_argument("--no-quant", action="store_true", help="skip the -4bit copies")
    args = ap.parse_args()
    for name in args.names:
        if name not in SPECS:
            die(f"unknown fixture {name!r}; known: {', '.join(SPECS)}")
    for name in args.names or SPECS:
        seed, cfg = SPECS[name]
        predicate = None
        if name == "qwen3_5":
            src = save(name, cfg, build_qwen3_5_hf(cfg, seed), fmt="pt")
        elif name == "qwen3_5_moe":
            src = save(name, cfg, build_qwen3_5_moe_hf(cfg, seed), fmt="pt")
        elif name == "glm4_moe":
            src = save(name, cfg, build_glm4_moe_hf(cfg, seed))
        elif name == "glm4_moe_lite":
            src = save(name, cfg, build_glm4_moe_lite_hf(cfg, seed))
        elif name == "qwen3_moe":
            src = save(name, cfg, build_qwen3_moe_hf(cfg, seed))
            predicate = qwen3_moe_predicate
        else:
            src = save(name, cfg, build_mlx_lm(cfg, seed))
        if not args.no_quant:
            dst = quantize_copy(src, MODELS / f"{name}-4bit", predicate)
            if name == "glm4_moe_lite":
                glm_lite_kv_b_quantized(dst, layer=1)


if __name__ == "__main__":
    main()
