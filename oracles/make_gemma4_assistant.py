"""Builds golden/models/gemma4-vlm (the gemma4 fixture in the multimodal `gemma4` layout) and
trains golden/models/gemma4-assistant (mlx-vlm's Gemma 4 assistant drafter for it), on CPU.

gemma4-vlm: mlx-vlm runs Gemma 4 only as the multimodal `gemma4` model (model_type gemma4, a
text_config, a vision tower), and mlx-lm loads that layout as text (mlx_lm/models/gemma4.py).
The folder holds golden/models/gemma4's text weights renamed to the Hugging Face layout
(`model.language_model.*`) with a sliding window of 512 instead of 16 (WINDOW), a one-layer random vision tower (`model.vision_tower.*`,
`model.embed_vision.*`; seeded, ~12k parameters, which mlx-lm's sanitize drops) and the same
tokenizer, so both libraries run golden/models/gemma4's text model, its window widened.

gemma4-assistant: model_type gemma4_assistant (mlx_vlm/speculative/drafters/gemma4_assistant/):
two KV-shared-only layers (sliding, full) that attend over the target's last sliding and last
full layer K/V, pre/post projections between the target's width (64) and its own (32), its own
tied embedding as output head. Why trained: a random drafter never matches the target
(docs/fixture-pitfalls.md, P13). Data: windows of the training stream extended by the target's
greedy continuation; for each generated position t the target's normed final hidden h_t and its
K/V come from one uncached forward (return_hidden, return_shared_kv). Step: two chained drafter
passes at RoPE position t over keys [0, t] (the sliding layer: the last `sliding_window`), the
first on [embed(x_{t+1}) * sqrt(H), h_t] predicting x_{t+2}, the second on [embed(x_{t+2}),
post_projection(first)] predicting x_{t+3}, as the MTP round loop chains them. AdamW, fixed
seeds; reproducible bit for bit under train.sh's serial OpenBLAS (P12).

Usage: make_gemma4_assistant.py [--steps N]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common import MODELS, copy_tokenizer, fresh_dir, log, read_json, write_json
from train_tiny import clipped_step, token_streams

VLM, ASSISTANT = "gemma4-vlm", "gemma4-assistant"
VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=1, num_key_value_heads=1, head_dim=32, global_head_dim=32,
              patch_size=4, position_embedding_size=16, pooling_kernel_size=2,
              default_output_length=4)
# Special ids mlx-vlm's config wants; none of them is generated on text prompts (vocab 1024).
SPECIAL = dict(image_token_id=1000, audio_token_id=1001, boi_token_id=1002, eoi_token_id=1003,
               boa_token_id=1004, eoa_token_id=1005)
DRAFT_TEXT = dict(model_type="gemma4_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                  num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=2,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=1024,
                  layer_types=["sliding_attention", "full_attention"], use_double_wide_mlp=True,
                  enable_moe_block=False, rms_norm_eps=1e-6, vocab_size=1024,
                  max_position_embeddings=4096, tie_word_embeddings=True)
BLOCK = 4
# The sliding window of gemma4-vlm: every manifest prompt and its 48 tokens fit (the long prompt is
# 418 tokens). mlx-vlm's MTP loop swaps the target's rotating caches for BufferedRotatingKVCache,
# which can take back a round after the window wrapped; verity's cannot and refuses such rounds
# (docs/speculative.md), so a wrapping window would make the two loops' rounds differ.
WINDOW = 512
PROMPT, GEN, N_SEQ, BATCH, LR, SEED = 32, 40, 384, 32, 3e-3, 7


def build_vlm() -> tuple:
    from mlx_vlm.models.gemma4 import Model, ModelConfig
    from mlx_vlm.models.gemma4.config import TextConfig, VisionConfig

    src = read_json(MODELS / "gemma4" / "config.json")
    text = {k: v for k, v in src.items() if k not in ("architectures", "eos_token_id")}
    text["sliding_window"] = WINDOW
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": text, "vision_config": VISION, "vocab_size": src["vocab_size"],
           "eos_token_id": src["eos_token_id"], "tie_word_embeddings": True, **SPECIAL}
    mc = ModelConfig.from_dict(cfg)
    mc.text_config, mc.vision_config = TextConfig.from_dict(text), VisionConfig.from_dict(VISION)
    mx.random.seed(SEED)
    vision = {k: v for k, v in tree_flatten(Model(mc).parameters())
              if not k.startswith("language_model.")}
    weights = {f"model.{k}": v for k, v in vision.items()}
    for k, v in mx.load(str(MODELS / "gemma4" / "model.safetensors")).items():
        weights["model.language_model." + k.removeprefix("model.")] = v
    out = fresh_dir(MODELS / VLM)
    write_json(out / "config.json", cfg)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    copy_tokenizer(out)
    log(f"{VLM}: {len(weights)} tensors ({len(vision)} vision)")
    return cfg


def drafter_config(target: dict) -> dict:
    text = target["text_config"]
    dt = {**DRAFT_TEXT, "sliding_window": text["sliding_window"],
          "rope_parameters": text["rope_parameters"]}
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            "backbone_hidden_size": text["hidden_size"], "use_ordered_embeddings": False,
            "tie_word_embeddings": True, "block_size": BLOCK, "text_config": dt}


def target_data(model, stream, rng):
    """Greedy continuations of N_SEQ random windows; normed final hidden and shared K/V."""
    lm = model.language_model
    starts = rng.integers(0, len(stream) - PROMPT, size=N_SEQ)
    prompts = np.stack([stream[s:s + PROMPT] for s in starts])
    seqs = []
    for i in range(0, N_SEQ, 64):
        from mlx_vlm.models.cache import make_prompt_cache
        cache = make_prompt_cache(lm)
        x = mx.array(prompts[i:i + 64])
        y = mx.argmax(lm(x, cache=cache).logits[:, -1], axis=-1)
        out = [y]
        for _ in range(GEN - 1):
            y = mx.argmax(lm(y[:, None], cache=cache).logits[:, -1], axis=-1)
            out.append(y)
            mx.eval(y)
        seqs.append(np.concatenate([prompts[i:i + 64], np.array(mx.stack(out, axis=1))], axis=1))
    seqs = mx.array(np.concatenate(seqs).astype(np.int32))
    out = lm(seqs, return_hidden=True, return_shared_kv=True)
    hidden = lm.speculative_draft_hidden(out.hidden_states[-1])
    kv = out.shared_kv_states
    mx.eval(hidden, kv)
    return seqs, hidden, kv


def masks(t_len: int, window: int) -> dict:
    q = mx.arange(t_len)[:, None]
    k = mx.arange(t_len)[None, :]
    inf = mx.array(-mx.inf)
    full = mx.where(k <= q, mx.array(0.0), inf)
    return {"full_attention": full, "sliding_attention": mx.where((k <= q) & (k > q - window), 0.0, inf)}


def draft_pass(drafter, x, kv, m):
    h = drafter.pre_projection(x)
    for layer in drafter.model.layers:
        h, _, _ = layer(h, mask=m[layer.layer_type], cache=None, per_layer_input=None,
                        shared_kv=kv[layer.layer_type], offset=mx.array(0))
    h = drafter.model.norm(h)
    return drafter.post_projection(h), drafter.model.embed_tokens.as_linear(h)


def loss_fn(drafter, embed, seqs, hidden, kv, m):
    """Two chained passes over every position t; loss on the generated positions only."""
    t_len = seqs.shape[1] - 3
    e1 = embed(seqs[:, 1:t_len + 1])
    h1, l1 = draft_pass(drafter, mx.concatenate([e1, hidden[:, :t_len]], axis=-1), kv, m)
    e2 = embed(seqs[:, 2:t_len + 2])
    _, l2 = draft_pass(drafter, mx.concatenate([e2, h1], axis=-1), kv, m)
    w = (mx.arange(t_len) >= PROMPT - 1).astype(mx.float32)[None, :]
    ce1 = nn.losses.cross_entropy(l1, seqs[:, 2:t_len + 2], reduction="none")
    ce2 = nn.losses.cross_entropy(l2, seqs[:, 3:t_len + 3], reduction="none")
    return ((ce1 + 0.5 * ce2) * w).sum() / (w.sum() * seqs.shape[0])


def train(cfg: dict, steps: int):
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters.gemma4_assistant import Gemma4AssistantDraftModel, ModelConfig

    model, _ = load(str(MODELS / VLM))
    inner = model.language_model.model
    embed_scale = inner.embed_scale

    def embed(ids):
        return inner.embed_tokens(ids) * embed_scale

    rng = np.random.default_rng(SEED)
    stream, _ = token_streams()
    seqs, hidden, kv = target_data(model, stream, rng)
    log(f"{ASSISTANT}: {seqs.shape[0]} sequences of {seqs.shape[1]} tokens")
    t_len = seqs.shape[1] - 3
    hidden = hidden[:, :t_len]
    m = masks(t_len, cfg["text_config"]["sliding_window"])
    mx.random.seed(SEED)
    drafter = Gemma4AssistantDraftModel(ModelConfig.from_dict(cfg))
    opt = optim.AdamW(learning_rate=optim.cosine_decay(LR, steps, LR / 20), weight_decay=0.01)
    grad_fn = nn.value_and_grad(drafter, loss_fn)
    curve = []
    for step in range(steps):
        idx = mx.array(rng.integers(0, seqs.shape[0], size=BATCH))
        batch_kv = {k: (kk[idx][..., :t_len, :], vv[idx][..., :t_len, :]) for k, (kk, vv) in kv.items()}
        loss = clipped_step(lambda d, *b: grad_fn(d, embed, *b), drafter, opt, 1.0,
                            (seqs[idx], hidden[idx], batch_kv, m), f"{ASSISTANT} step {step}")
        if step % 50 == 0 or step == steps - 1:
            curve.append([step, loss])
            log(f"{ASSISTANT}: step {step} loss {loss}")
    out = fresh_dir(MODELS / ASSISTANT)
    write_json(out / "config.json", cfg)
    weights = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "training_log.json", {"seed": SEED, "steps": steps, "batch": BATCH, "lr": LR,
                                           "sequences": N_SEQ, "prompt": PROMPT, "generated": GEN,
                                           "loss": curve})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    cfg = build_vlm()
    train(drafter_config(cfg), args.steps)
    log("done")


if __name__ == "__main__":
    main()
