"""Train a tiny DFlash block drafter (mlx-vlm's qwen3_dflash) for a golden target, on CPU.

Why trained: a random drafter never matches its target, so a DFlash trace would hold no accepted
draft and test nothing of the round loop (docs/fixture-pitfalls.md, P13). Self-distillation makes
the drafter predict the target's own greedy continuation, so acceptance is clearly non-zero.

Targets: qwen3-target (trained, mlx_lm; taps captured by running its layers here) and qwen3_5
(random hybrid gated-DeltaNet, mlx_vlm; taps from capture_layer_ids). The drafter borrows the
target's embedding and lm_head (bound, frozen, never saved): only its own weights go to
model.safetensors, in the key names mlx_vlm's load_model expects for model_type qwen3_dflash.

Data: prompts from the training token stream of train_tiny.py in three fixed lengths (BUCKETS;
half random windows, half windows ending at "<|im_start|>assistant\\n"), each extended by the
target's greedy continuation (batched, KV cache); the taps (raw outputs of target_layer_ids,
concatenated) come from one forward over the whole sequence. Held-out prompts come from the
held-out stream. Step: one bucket, one anchor p in its generated part for a minibatch: context = tap rows [0, p),
block = [tok_p, mask * (bs - 1)], labels tok_{p+1..p+bs-1}, cross entropy on block rows 1..
weighted exp(-(k-1)/GAMMA) (early rows decide acceptance). The drafter's KV cache is replaced by
a pass-through (offset 0), which is what the real loop computes with a cache holding rows [0, p).
Optimisation: AdamW, warmup then cosine, grad clip, fixed seeds. Reproducible bit for bit through
train.sh (serial OpenBLAS, one thread). training_log.json: seed, steps, loss curve, held-out
per-position accuracy, and greedy acceptance of a faithful round loop on the manifest prompts.

Usage: train_dflash.py {qwen3-target,qwen3_5} [--steps N] [--out DIR]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import hashlib
import os
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common import GOLDEN, MODELS, die, fresh_dir, log, model_dir, write_json
from train_tiny import clipped_step, prompts_from, token_streams

BLOCK, TAPS, MASK_ID = 8, [1, 3], 1
# model_type "qwen3" + dflash_config, as the published Qwen3 DFlash checkpoints: mlx_vlm's loader
# maps that pair to its qwen3_dflash drafter (mlx_vlm/utils.py, get_model_type); a literal
# "qwen3_dflash" would be looked up as "qwen3_dflash_dflash" and fail to load.
BASE = dict(
    model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=128,
    intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, rms_norm_eps=1e-6, vocab_size=1024, max_position_embeddings=4096,
)
SPECS = {  # target -> (drafter folder, seed, rope_theta)
    "qwen3-target": ("qwen3-target-dflash", 0, 1000000.0),
    "qwen3_5": ("qwen3_5-dflash", 1, 100000.0),
}
# Prompt-length buckets: (prompt tokens, train sequences, share of the steps). Each bucket's
# sequences are its prompts + GEN greedy tokens; the long bucket teaches positions the manifest's
# long prompt reaches (418 tokens).
BUCKETS = ((32, 1024, 0.5), (128, 256, 0.3), (400, 128, 0.2))
GEN, N_VAL = 56, 32
STEPS, BATCH = 2000, 64
LR, LR_END, WARMUP, WD, CLIP, GAMMA = 3e-3, 1.5e-4, 50, 0.01, 1.0, 4.0
ACCEPT_PROMPTS = ("code", "chat", "chat-sort", "unicode", "long")
ACCEPT_MAX_TOKENS = 48


def drafter_config(rope_theta: float) -> dict:
    return {**BASE, "rope_theta": rope_theta, "tie_word_embeddings": True, "block_size": BLOCK,
            "num_target_layers": 4, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS}}


class Target:
    """The target behind one interface: batched greedy continuation, tap capture, plain greedy."""

    def __init__(self, name: str):
        self.name, path = name, str(model_dir(name))
        if name == "qwen3_5":
            from mlx_vlm import load
            self.model, self.processor = load(path)
            self.tokenizer = self.processor.tokenizer
            self.lm = self.model.language_model
        else:
            from mlx_lm import load
            self.model, self.tokenizer = load(path)
            self.lm = self.model

    def _fresh(self):
        for attr in ("_position_ids", "_rope_deltas"):  # mlx_vlm's mRoPE state between requests
            if hasattr(self.lm, attr):
                setattr(self.lm, attr, None)

    def cache(self):
        self._fresh()
        if self.name == "qwen3_5":
            from mlx_vlm.models.cache import make_prompt_cache
            return make_prompt_cache(self.lm)
        from mlx_lm.models.cache import make_prompt_cache
        return make_prompt_cache(self.model)

    def logits(self, x, cache):
        out = self.lm(x, cache=cache)
        return out.logits if self.name == "qwen3_5" else out

    def forward_taps(self, x, cache=None):
        """(logits, taps) for tokens x; taps = raw outputs of TAPS layers concatenated."""
        if self.name == "qwen3_5":
            if cache is None:
                self._fresh()
            out = self.lm(x, cache=cache, capture_layer_ids=TAPS)
            return out.logits, mx.concatenate(out.hidden_states, axis=-1)
        from mlx_lm.models.base import create_attention_mask
        inner = self.model.model
        h = inner.embed_tokens(x)
        caches = cache or [None] * len(inner.layers)
        mask = create_attention_mask(h, caches[0])
        taps = []
        for i, (layer, c) in enumerate(zip(inner.layers, caches)):
            h = layer(h, mask, c)
            if i in TAPS:
                taps.append(h)
        return self.model.model.embed_tokens.as_linear(inner.norm(h)), mx.concatenate(taps, axis=-1)

    def continue_greedy(self, prompts: np.ndarray, n: int) -> np.ndarray:
        cache = self.cache()
        y = mx.argmax(self.logits(mx.array(prompts), cache)[:, -1], axis=-1)
        out = [y]
        for _ in range(n - 1):
            y = mx.argmax(self.logits(y[:, None], cache)[:, -1], axis=-1)
            out.append(y)
            mx.eval(y)
        return np.concatenate([prompts, np.array(mx.stack(out, axis=1))], axis=1).astype(np.int32)

    def taps(self, seqs: np.ndarray, chunk: int = 64) -> mx.array:
        parts = []
        for i in range(0, len(seqs), chunk):
            parts.append(self.forward_taps(mx.array(seqs[i:i + chunk]))[1])
            mx.eval(parts[-1])
        return mx.concatenate(parts, axis=0)


class PassThrough:
    """A drafter cache that holds nothing: offset 0, update_and_fetch returns its inputs."""
    offset = 0

    def update_and_fetch(self, k, v):
        return k, v


def block_inputs(seqs: mx.array, p: int):
    n = seqs.shape[0]
    block = mx.concatenate([seqs[:, p:p + 1], mx.full((n, BLOCK - 1), MASK_ID, dtype=seqs.dtype)], axis=1)
    return block, seqs[:, p + 1:p + BLOCK]


def draft_logits(drafter, taps, seqs, p):
    drafter._fused_context_kv_weight = None  # cached fused K/V weight: stale after every update
    block, labels = block_inputs(seqs, p)
    logits = drafter(block, taps[:, :p], [PassThrough() for _ in drafter.layers])[:, 1:]
    return logits, labels


def evaluate(drafter, buckets):
    """Teacher-forced held-out accuracy per block row 1..BLOCK-1 over every anchor in the generated
    part of every bucket, and the mean run of correct rows from row 1 (= greedy accepted drafts
    per round)."""
    hits, runs = [], []
    for taps, seqs, prompt in buckets:
        for p in range(prompt, seqs.shape[1] - BLOCK + 1):
            logits, labels = draft_logits(drafter, taps, seqs, p)
            ok = np.array(mx.argmax(logits, axis=-1) == labels)
            hits.append(ok.mean(axis=0))
            runs.append(np.cumprod(ok, axis=1).sum(axis=1).mean())
    drafter._fused_context_kv_weight = None
    return [round(float(a), 4) for a in np.mean(hits, axis=0)], round(float(np.mean(runs)), 4)


def manifest_prompts(tokenizer) -> dict:
    prompts = tomllib.loads((GOLDEN / "MANIFEST.toml").read_text())["prompts"]
    out = {}
    for name in ACCEPT_PROMPTS:
        p = prompts[name]
        if p.get("chat", False):
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}],
                                                 tokenize=False, add_generation_prompt=True)
            out[name] = tokenizer.encode(text, add_special_tokens=False)
        else:
            out[name] = tokenizer.encode(p["text"], add_special_tokens=True)
    return out


def accept_python(target: Target, drafter, tokens: list[int], bs: int):
    """A faithful greedy DFlash round loop for the mlx_lm target (fixed block size bs): prefill with
    taps, then draft -> verify [bonus, drafts] with taps -> accept the matching prefix + the target's
    token -> trim the rejected rows from the target cache; the accepted rows' taps are the next
    context. Returns (tokens, accept_lens); the tokens must equal plain greedy."""
    from mlx_lm.models.cache import trim_prompt_cache
    eos = set(target.tokenizer.eos_token_ids)
    cache, dcache = target.cache(), drafter.reset(target.model)
    logits, hidden = target.forward_taps(mx.array([tokens]), cache)
    out = [int(mx.argmax(logits[0, -1]))]
    while len(out) < ACCEPT_MAX_TOKENS and out[-1] not in eos:
        k = min(bs, ACCEPT_MAX_TOKENS - len(out) + 1)
        if k <= 1:
            break
        drafts = drafter.draft_block(out[-1], hidden, dcache, k, lambda l: mx.argmax(l, axis=-1))
        verify = mx.concatenate([mx.array([[out[-1]]]), drafts], axis=1)
        logits, hidden = target.forward_taps(verify, cache)
        d, t = drafts[0].tolist(), mx.argmax(logits[0], axis=-1).tolist()
        acc = next((i for i, (a, b) in enumerate(zip(d, t)) if a != b), len(d))
        new = d[:acc] + [t[acc]]
        drafter.accept_lens.append(acc)
        trim_prompt_cache(cache, k - 1 - acc)
        hidden = hidden[:, :acc + 1]
        for tok in new:
            if len(out) < ACCEPT_MAX_TOKENS and out[-1] not in eos:
                out.append(tok)
    return out, list(drafter.accept_lens)


def plain_python(target: Target, tokens: list[int]):
    eos, cache = set(target.tokenizer.eos_token_ids), target.cache()
    out = [int(mx.argmax(target.logits(mx.array([tokens]), cache)[0, -1]))]
    while len(out) < ACCEPT_MAX_TOKENS and out[-1] not in eos:
        out.append(int(mx.argmax(target.logits(mx.array([[out[-1]]]), cache)[0, -1])))
    return out


def accept_vlm(target: Target, drafter, tokens: list[int], bs: int):
    """mlx_vlm's own DFlash loop (greedy, adaptive block up to bs) and its plain run."""
    from mlx_vlm.generate import stream_generate

    def run(**kw):
        res = list(stream_generate(target.model, target.processor, "", input_ids=mx.array([tokens]),
                                   max_tokens=ACCEPT_MAX_TOKENS, temperature=0.0, **kw))
        return res[-1].token_ids

    spec = run(draft_model=drafter, draft_kind="dflash", draft_block_size=bs)
    return spec, list(drafter.accept_lens), run()


def acceptance(target: Target, drafter) -> dict:
    """Mean accepted drafts per round on the manifest prompts, per block size; checks spec == plain."""
    table = {}
    prompts = manifest_prompts(target.tokenizer)
    for bs in (4, BLOCK):
        rounds, per_prompt = [], {}
        for name, tokens in prompts.items():
            if target.name == "qwen3_5":
                spec, lens, plain = accept_vlm(target, drafter, tokens, bs)
            else:
                (spec, lens), plain = accept_python(target, drafter, tokens, bs), plain_python(target, tokens)
            if spec != plain:
                die(f"{target.name} bs {bs} {name}: speculative tokens differ from plain greedy")
            rounds += lens
            per_prompt[name] = lens
        drafter._fused_context_kv_weight = None
        table[f"block_size_{bs}"] = {"mean_accepted_per_round": round(float(np.mean(rounds)), 4),
                                     "rounds": len(rounds), "accept_lens": per_prompt}
        log(f"{target.name}: block {bs}: mean accepted per round {np.mean(rounds):.3f} over {len(rounds)} rounds")
    return table


def train(name: str, steps: int, out: Path):
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    folder, seed, rope_theta = SPECS[name]
    cfg = drafter_config(rope_theta)
    target = Target(name)
    log(f"{name}: tokenizing the corpus")
    train_ids, val_ids = token_streams()
    header = target.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    rng = np.random.default_rng(seed)
    data = {"train": [], "val": []}
    for length, n_train, _ in BUCKETS:
        for split, stream, n in (("train", train_ids, n_train), ("val", val_ids, N_VAL)):
            seqs = target.continue_greedy(prompts_from(stream, n, length, header, rng), GEN)
            data[split].append((target.taps(seqs), mx.array(seqs), length))
            log(f"{name}: {split}: {n} sequences of {length} + {GEN} tokens")
    mask_rate = float(np.mean([(np.array(s[:, p:]) == MASK_ID).mean() for _, s, p in data["train"]]))

    mx.random.seed(seed)
    drafter = DFlashDraftModel(ModelConfig.from_dict(dict(cfg)))
    drafter.bind(target.model)
    drafter.embed_tokens.freeze()
    if isinstance(drafter.lm_head, nn.Module):
        drafter.lm_head.freeze()
    own = lambda k: not k.startswith(("embed_tokens.", "lm_head."))  # noqa: E731
    n_params = sum(v.size for k, v in tree_flatten(drafter.parameters()) if own(k))
    trainable = sorted(k for k, _ in tree_flatten(drafter.trainable_parameters()))
    if not all(map(own, trainable)):
        die(f"borrowed target weights are trainable: {trainable}")
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, LR, WARMUP), optim.cosine_decay(LR, max(1, steps - WARMUP), LR_END)],
        [WARMUP])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=WD)
    weights = mx.exp(-mx.arange(BLOCK - 1, dtype=mx.float32) / GAMMA)

    def loss_fn(model, taps, seqs, p):
        logits, labels = draft_logits(model, taps, seqs, p)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        return (ce * weights).sum() / (weights.sum() * seqs.shape[0])

    grad_fn = nn.value_and_grad(drafter, loss_fn)
    shares = np.array([share for *_, share in BUCKETS])
    losses, evals = [], []
    log(f"{name}: drafter {n_params / 1e3:.0f}k params, {steps} steps of {BATCH} sequences")
    for i in range(1, steps + 1):
        taps, seqs, prompt = data["train"][rng.choice(len(BUCKETS), p=shares / shares.sum())]
        idx = mx.array(rng.choice(seqs.shape[0], size=BATCH, replace=False))
        anchor = int(rng.integers(prompt, seqs.shape[1] - BLOCK + 1))
        batch = (taps[idx], seqs[idx], anchor)
        losses.append(clipped_step(grad_fn, drafter, opt, CLIP, batch, f"{name}, step {i}"))
        if i % 500 == 0 or i == steps:
            acc, run = evaluate(drafter, data["val"])
            evals.append({"step": i, "val_accuracy_per_position": acc, "val_mean_accepted": run})
            log(f"{name}: step {i} loss {np.mean(losses[-100:]):.3f} val acc {acc} accepted/round {run}")
    drafter._fused_context_kv_weight = None

    out = fresh_dir(out)
    own_weights = dict(sorted((k, v) for k, v in tree_flatten(drafter.parameters()) if own(k)))
    mx.save_safetensors(str(out / "model.safetensors"), own_weights, metadata={"format": "mlx"})
    write_json(out / "config.json", cfg)
    check_load(out, target)
    log(f"{name}: measuring greedy acceptance on the manifest prompts")
    accept = acceptance(target, drafter)
    write_json(out / "training_log.json", {
        "model": folder, "target": f"golden/models/{name}", "params": n_params, "seed": seed,
        "steps": steps, "batch": BATCH, "generated_tokens": GEN,
        "buckets": [{"prompt_tokens": p, "train_sequences": n, "step_share": w} for p, n, w in BUCKETS],
        "val_sequences_per_bucket": N_VAL, "block_size": BLOCK,
        "target_layer_ids": TAPS, "mask_token_id": MASK_ID, "mask_token_rate_in_targets": round(mask_rate, 6),
        "loss_weights": f"exp(-(k-1)/{GAMMA}) for block row k",
        "optimizer": {"name": "AdamW", "lr": LR, "lr_end": LR_END, "warmup": WARMUP,
                      "schedule": "linear warmup then cosine", "weight_decay": WD, "grad_clip": CLIP},
        "blas": os.environ.get("LD_PRELOAD", "") and Path(os.environ["LD_PRELOAD"]).name,
        "val": evals, "acceptance": accept, "loss": losses,
    })
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    log(f"{name}: saved {out} (model.safetensors sha256 {digest[:16]})")


def check_load(path: Path, target: Target):
    """The saved folder loads through mlx_vlm's own drafter loader (strict) and binds to the target."""
    from mlx_vlm.speculative.drafters import load_drafter
    drafter, kind = load_drafter(str(path), kind="dflash")
    if kind != "dflash" or type(drafter).__name__ != "DFlashDraftModel":
        die(f"{path}: load_drafter gave {type(drafter).__name__} / {kind}")
    drafter.bind(target.model)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", choices=sorted(SPECS))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, help="output folder (default golden/models/<drafter>)")
    args = ap.parse_args()
    if args.steps < 1:
        die("--steps must be positive")
    if not os.environ.get("LD_PRELOAD"):
        log("warning: no OpenBLAS preloaded (use train.sh); training will be slower")
    train(args.target, args.steps, (args.out or MODELS / SPECS[args.target][0]).resolve())


if __name__ == "__main__":
    main()
