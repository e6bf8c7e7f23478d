"""Train qwen3_5-trained: the qwen3_5 fixture's hybrid gated-DeltaNet text model and its native MTP
head, on the stdlib corpus, on CPU.

Why trained: the random qwen3_5 fixture's MTP head never matches its target (mlx-vlm accepts 0
drafts, golden/accept/mtp.toml), so an MTP trace holds no accepted draft and tests nothing of the
round loop (docs/fixture-pitfalls.md, P13). This sibling has the same config.json, key set and
layout as golden/models/qwen3_5 (which stays as it is), but writes Python-like text and chat
answers ending in <|im_end|>, and its MTP head predicts the token after next well above chance.

Data: train_tiny.token_streams (the pinned stdlib files plus chat pairs rendered with the golden
chat template, documents separated by <|endoftext|>; validation = the held-out files and their
pairs); random SEQ+1-token windows from a seeded numpy Generator.
Model: mlx-vlm's own classes, default MLX init: the text model is mlx_vlm.models.qwen3_5's
LanguageModel (seed 0), the head mlx-vlm's Qwen3_5MTPDraftModel (seed 1), the very class
load_drafter(kind="mtp") builds. The vision tower (unused for text) is copied verbatim from
golden/models/qwen3_5. Training runs the text model through mlx-vlm's CPU prefill path (the chunked
gated-delta scan, gated_delta.py gated_delta_chunked).
The head's inputs are exactly what mlx-vlm feeds it at inference (speculative/mtp.py _mtp_rounds,
speculative/utils.py run_speculative_rounds, drafters/qwen3_5_mtp/qwen3_5_mtp.py): the target's
hidden state AFTER its final norm (LanguageModel's hidden_states[-1] = model.norm(h)) at position
t and the target's own embedding of token t+1 -> fc(concat[pre_fc_norm_embedding(embed),
pre_fc_norm_hidden(hidden)]) -> one full-attention decoder layer (own KV cache, rope position t)
-> norm -> the target's lm_head -> token t+2. Drafts after the first chain: draft_block feeds the
head its own normed output as the next hidden, with the embedding of its own draft.
Loss: LM cross entropy + sum over chain steps s = 1..DEPTH of MTP_WEIGHTS[s-1] x cross entropy of
step s, gradients into the trunk too. Step 1 runs over every window position with a causal mask,
as prefill_from_target_hidden does over a prompt; step s >= 2 at position j takes step s-1's output
at j-1 and the embedding of token j+1 and attends to step-1 keys at positions <= j-s+1, the
step-r key at j-s+r (r = 2..s) and its own, i.e. the drafter's KV cache when it drafts position s
of a round.
Optimisation: AdamW (wd 0.01), 50 warmup steps then cosine 3e-3 -> 1.5e-4, grad-norm clip 1.0,
batch BATCH x SEQ, fixed step count; not compiled (mx.compile of this graph takes minutes on CPU
and does not speed the step up). STEPS is set by the budget of ~20 CPU-minutes on one core: a
step through mlx-vlm's chunked scan costs ~1.7 s (more beside a busy core), so 540 steps (1.1M
tokens) instead of train_tiny's 1500.
Output (golden/models/qwen3_5-trained): HF layout exactly as make_models.py writes qwen3_5
(model.language_model.*, lm_head.weight, conv1d (C,1,K), zero-centred input/post-attention/final/
q/k norms, mtp.* with zero-centred norms, model.visual.*), safetensors metadata {"format": "pt"}
(the MTP splitter would skip the +1 on the mtp norms of an "mlx" file), config.json copied from
golden/models/qwen3_5, the golden tokenizer files. The saved folder is then loaded back with
mlx_vlm.load and load_drafter(kind="mtp") (every weight must come back), and the final evaluation
and the acceptance run on that loaded copy.
training_log.json: seed, steps, loss curve, held-out LM and per-step MTP accuracy (with the
most-frequent-token baseline), mlx-vlm's greedy MTP acceptance per draft position on the manifest
prompts (spec == plain checked) and the plain greedy texts.
Reproducible bit for bit when run through train.sh (serial OpenBLAS, one thread): same command,
same weights and training_log.json.

Usage: train_mtp.py [--steps N] [--out DIR]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import copy
import hashlib
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common import MODELS, copy_tokenizer, die, fresh_dir, log, model_dir, read_json, write_json
from make_models import hf_zero_centred
from train_dflash import ACCEPT_MAX_TOKENS, ACCEPT_PROMPTS, manifest_prompts
from train_tiny import clipped_step, token_streams

SOURCE, FOLDER, SEED = "qwen3_5", "qwen3_5-trained", 0
STEPS, BATCH, SEQ = 540, 16, 128
DEPTH, MTP_WEIGHTS = 3, (0.5, 0.25, 0.125)
LR, LR_END, WARMUP, WD, CLIP = 3e-3, 1.5e-4, 50, 0.01, 1.0
EVAL_EVERY, EVAL_WINDOWS = 100, 64
ACCEPT_BLOCK_SIZES = (2, 3, 4)


class Trainee(nn.Module):
    """The text model and the MTP head under one optimizer."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__()
        from mlx_vlm.models.qwen3_5 import ModelConfig
        from mlx_vlm.models.qwen3_5.language import LanguageModel
        from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as MTPConfig
        from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel

        config = ModelConfig.from_dict(copy.deepcopy(cfg))
        mx.random.seed(seed)
        self.language_model = LanguageModel(config.text_config, config)
        mx.random.seed(seed + 1)
        self.mtp = Qwen3_5MTPDraftModel(MTPConfig.from_dict({"text_config": copy.deepcopy(cfg["text_config"])}))


class Keys:
    """A stand-in KV cache for one MTP pass: prepends the keys/values of earlier chain steps and
    remembers this pass's own (already rotated) ones."""

    def __init__(self, keys=(), values=()):
        self.prev_keys, self.prev_values = list(keys), list(values)
        self.offset = sum(k.shape[2] for k in keys)  # only bounds the mask slice in the layer

    def update_and_fetch(self, k, v):
        self.keys, self.values = k, v
        return mx.concatenate(self.prev_keys + [k], axis=2), mx.concatenate(self.prev_values + [v], axis=2)


def chain_masks(m: int) -> list:
    """Boolean attention masks of chain steps 1..DEPTH over m MTP positions (see the docstring)."""
    masks = []
    for s in range(1, DEPTH + 1):
        q = np.arange(s - 1, m)[:, None]  # query positions j
        blocks = [np.arange(m)[None, :] <= q - (s - 1)]
        blocks += [np.arange(r - 1, m)[None, :] == q - (s - r) for r in range(2, s + 1)]
        masks.append(mx.array(np.concatenate(blocks, axis=1)))
    return masks


def mtp_layer_pass(mtp, embed, hidden, positions, cache, mask):
    """Qwen3_5MTPDraftModel._forward_hidden with a given KV stand-in and mask."""
    h = mtp.fc(mx.concatenate([mtp.pre_fc_norm_embedding(embed), mtp.pre_fc_norm_hidden(hidden)], axis=-1))
    for layer in mtp.layers:
        h = layer(h, mask=mask, cache=cache, position_ids=positions)
    return mtp.norm(h)


def forward(lm, mtp, tokens, masks):
    """(LM logits, [MTP logits of step s]) for windows `tokens` (B, SEQ+1): the LM reads tokens
    [0, SEQ) and predicts [1, SEQ]; step s predicts tokens [s + 1, SEQ]."""
    b, n = tokens.shape
    x, m = tokens[:, :-1], n - 2
    positions = mx.broadcast_to(mx.arange(n - 1)[None], (b, n - 1))
    hidden = lm.model(x, position_ids=positions)  # post final norm, as mlx-vlm hands it over
    logits = lm.lm_head(hidden)
    embeds = lm.model.embed_tokens(tokens[:, 1:n - 1])  # embeddings of tokens 1..m
    outs, keys, values, prev = [], [], [], hidden[:, :m]
    for s in range(1, DEPTH + 1):
        cache = Keys(keys, values)
        h = mtp_layer_pass(mtp, embeds[:, s - 1:], prev, positions[:, s - 1:m], cache, masks[s - 1])
        keys.append(cache.keys)
        values.append(cache.values)
        outs.append(lm.lm_head(h))
        prev = h[:, :-1]
    return logits, outs


def loss_fn(model, tokens, masks):
    logits, outs = forward(model.language_model, model.mtp, tokens, masks)
    loss = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")
    for s, (w, out) in enumerate(zip(MTP_WEIGHTS, outs), start=1):
        loss = loss + w * nn.losses.cross_entropy(out, tokens[:, s + 1:], reduction="mean")
    return loss


def evaluate(lm, mtp, windows: mx.array, masks, chunk: int = 16) -> dict:
    """Held-out loss and top-1 accuracy of the LM and of every MTP chain step (teacher forced)."""
    sums = np.zeros((DEPTH + 1, 3))  # loss sum, hits, count
    for i in range(0, windows.shape[0], chunk):
        w = windows[i:i + chunk]
        logits, outs = forward(lm, mtp, w, masks)
        for row, (out, target) in enumerate([(logits, w[:, 1:])] + [(o, w[:, s + 1:]) for s, o in enumerate(outs, 1)]):
            ce = nn.losses.cross_entropy(out, target, reduction="sum")
            hits = (mx.argmax(out, axis=-1) == target).sum()
            sums[row] += [float(ce), float(hits), target.size]
    rows = [{"loss": round(float(l / n), 5), "accuracy": round(float(h / n), 4)} for l, h, n in sums]
    return {"lm": rows[0], "mtp_steps": rows[1:]}


def to_hf(lm_params: dict, mtp_params: dict, visual: dict) -> dict:
    """mlx-vlm parameter names/layouts -> the HF checkpoint layout of golden/models/qwen3_5."""
    out = {}
    for k, v in lm_params.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        elif k != "lm_head.weight":
            die(f"unexpected language model parameter {k}")
        out[k] = v
    out.update({"mtp." + k: v for k, v in mtp_params.items()})
    for k, v in out.items():
        if k.endswith("conv1d.weight"):  # MLX (C, K, 1) -> PyTorch (C, 1, K)
            out[k] = v.moveaxis(2, 1)
        elif hf_zero_centred(k):
            out[k] = v - 1.0  # zero-centred, as HF stores Qwen3_5RMSNorm
    out.update(visual)
    return dict(sorted(out.items()))


def load_back(path: Path, trained: dict):
    """Loads the saved folder the way record_vlm.py does and checks every weight came back."""
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = load(str(path))
    drafter, kind = load_drafter(str(path), kind="mtp")
    if kind != "mtp" or type(drafter).__name__ != "Qwen3_5MTPDraftModel":
        die(f"{path}: load_drafter gave {type(drafter).__name__} / {kind}")
    drafter.bind(model)
    loaded = {"language_model." + k: v for k, v in tree_flatten(model.language_model.parameters())}
    loaded.update({"mtp." + k: v for k, v in tree_flatten(drafter.parameters())})
    if set(loaded) != set(trained):
        die(f"{path}: loaded keys differ: {sorted(set(loaded) ^ set(trained))[:6]}")
    # Norms travel as w - 1 and come back as (w - 1) + 1: exact for w in [0.5, 2], else one rounding.
    worst = max(float(mx.abs(loaded[k] - v).max()) for k, v in trained.items())
    if worst > 1e-6:
        die(f"{path}: a loaded weight differs from the trained one by {worst}")
    return model, processor, drafter, worst


def acceptance(model, processor, drafter) -> dict:
    """mlx-vlm's greedy MTP loop on the manifest prompts: per block size, the rounds' draft and
    accept lengths, counted per draft position; every run must equal plain greedy."""
    from mlx_vlm.generate import stream_generate

    def run(tokens, **kw):
        return list(stream_generate(model, processor, "", input_ids=mx.array([tokens]),
                                    max_tokens=ACCEPT_MAX_TOKENS, temperature=0.0, **kw))[-1].token_ids

    prompts = manifest_prompts(processor.tokenizer)
    plain = {name: run(tokens) for name, tokens in prompts.items()}
    table = {}
    for bs in ACCEPT_BLOCK_SIZES:
        drafted, accepted, emitted, per_prompt = np.zeros(bs - 1, int), np.zeros(bs - 1, int), 0, {}
        for name, tokens in prompts.items():
            spec = run(tokens, draft_model=drafter, draft_kind="mtp", draft_block_size=bs)
            if spec != plain[name]:
                die(f"block {bs} {name}: mlx-vlm's MTP run emitted other tokens than its plain run")
            lens = [int(a) for a in drafter.accept_lens]
            for d, a in zip(drafter.draft_lens, lens):
                drafted[:d] += 1
                accepted[:a] += 1
            emitted += len(spec)
            per_prompt[name] = lens
        rates = [round(float(a / d), 4) for a, d in zip(accepted, drafted)]
        table[f"block_size_{bs}"] = {
            "drafted_by_pos": drafted.tolist(), "accepted_by_pos": accepted.tolist(),
            "accept_rate_by_pos": rates, "accepted_per_emitted": round(float(accepted.sum() / emitted), 4),
            "accept_lens": per_prompt,
        }
        log(f"block {bs}: accepted by position {rates}, {accepted.sum()} of {emitted} emitted tokens")
    texts = {name: processor.tokenizer.decode(ids) for name, ids in plain.items()}
    return table, texts


def train(steps: int, out: Path):
    src = model_dir(SOURCE)
    cfg = read_json(src / "config.json")
    log("tokenizing the corpus")
    train_ids, val_ids = token_streams()
    log(f"{len(train_ids)} train / {len(val_ids)} val tokens")
    model = Trainee(cfg, SEED)
    lm, mtp = model.language_model, model.mtp
    n_lm = sum(v.size for _, v in tree_flatten(lm.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(mtp.parameters()))
    if len(mtp.layers) != 1:  # forward() hands one Keys stand-in to every head layer
        die(f"the MTP chain here assumes mtp_num_hidden_layers 1, not {len(mtp.layers)}")
    masks = chain_masks(SEQ - 1)

    # The trunk pass with explicit positions is what LanguageModel's own call hands a drafter, and
    # the chain's step 1 is mlx-vlm's own prefill computation of the head (cache None, causal).
    probe = mx.array(train_ids[None, :SEQ + 1])
    hidden = lm.model(probe[:, :-1], position_ids=mx.arange(SEQ)[None])
    reference = lm(probe[:, :-1], return_hidden=True).hidden_states[-1]
    lm._position_ids = lm._rope_deltas = None
    if not mx.array_equal(hidden, reference):
        die("the trunk pass differs from LanguageModel's hidden_states[-1]")
    embeds = lm.model.embed_tokens(probe[:, 1:-1])
    ours = mtp_layer_pass(mtp, embeds, hidden[:, :-1], mx.arange(SEQ - 1)[None], Keys(), masks[0])
    theirs = mtp._forward_hidden(embeds, hidden[:, :-1], None, mx.arange(SEQ - 1)[None])
    if not mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
        die("the MTP step-1 pass differs from Qwen3_5MTPDraftModel._forward_hidden")

    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, LR, WARMUP), optim.cosine_decay(LR, max(1, steps - WARMUP), LR_END)],
        [WARMUP])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=WD)
    grad_fn = nn.value_and_grad(model, loss_fn)

    val_starts = np.linspace(0, len(val_ids) - SEQ - 2, EVAL_WINDOWS).astype(np.int64)
    val = mx.array(np.stack([val_ids[s:s + SEQ + 1] for s in val_starts]))
    counts = np.bincount(val_ids, minlength=1024)
    baseline = round(float(counts.max() / counts.sum()), 4)  # always guessing the most frequent token

    rng = np.random.default_rng(SEED)
    losses, evals = [], []
    log(f"{n_lm / 1e3:.0f}k text + {n_mtp / 1e3:.0f}k MTP params, {steps} steps of {BATCH}x{SEQ}, "
        f"MTP chain depth {DEPTH}")
    for i in range(1, steps + 1):
        starts = rng.integers(0, len(train_ids) - SEQ - 1, size=BATCH)
        batch = mx.array(np.stack([train_ids[s:s + SEQ + 1] for s in starts]))
        losses.append(clipped_step(grad_fn, model, opt, CLIP, (batch, masks), f"step {i}"))
        if i % EVAL_EVERY == 0 or i == steps:
            evals.append({"step": i, **evaluate(lm, mtp, val, masks)})
            e = evals[-1]
            log(f"step {i} loss {np.mean(losses[-50:]):.3f} val lm {e['lm']} mtp "
                + " ".join(f"{r['accuracy']:.3f}" for r in e["mtp_steps"]))

    out = fresh_dir(out)
    lm_params = dict(tree_flatten(lm.parameters()))
    mtp_params = dict(tree_flatten(mtp.parameters()))
    visual = {k: v for k, v in mx.load(str(src / "model.safetensors")).items() if k.startswith("model.visual.")}
    weights = to_hf(lm_params, mtp_params, visual)
    source_keys = set(mx.load(str(src / "model.safetensors")))
    if set(weights) != source_keys:
        die(f"key set differs from {SOURCE}: {sorted(set(weights) ^ source_keys)[:6]}")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_json(out / "config.json", cfg)
    copy_tokenizer(out)

    trained = {"language_model." + k: v for k, v in lm_params.items()}
    trained.update({"mtp." + k: v for k, v in mtp_params.items()})
    model, processor, drafter, roundtrip = load_back(out, trained)
    log(f"loaded back with mlx_vlm.load + load_drafter(kind='mtp'); largest weight change {roundtrip:.2e}")
    final = evaluate(model.language_model, drafter, val, masks)
    log(f"held out (loaded copy): lm {final['lm']}, mtp steps {final['mtp_steps']}, "
        f"most-frequent-token baseline {baseline}")
    log("measuring mlx-vlm's greedy MTP acceptance on the manifest prompts")
    accept, texts = acceptance(model, processor, drafter)
    write_json(out / "training_log.json", {
        "model": FOLDER, "config_from": f"golden/models/{SOURCE}", "seed": SEED,
        "params": {"text": n_lm, "mtp": n_mtp}, "steps": steps, "batch": BATCH, "seq": SEQ,
        "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
        "mtp_chain_depth": DEPTH, "mtp_loss_weights": list(MTP_WEIGHTS),
        "optimizer": {"name": "AdamW", "lr": LR, "lr_end": LR_END, "warmup": WARMUP,
                      "schedule": "linear warmup then cosine", "weight_decay": WD, "grad_clip": CLIP},
        "blas": os.environ.get("LD_PRELOAD", "") and Path(os.environ["LD_PRELOAD"]).name,
        "val_windows": EVAL_WINDOWS, "most_frequent_token_accuracy": baseline,
        "val": evals, "final_loaded": final,
        "acceptance": {"max_tokens": ACCEPT_MAX_TOKENS, "prompts": list(ACCEPT_PROMPTS), **accept},
        "greedy_texts": texts, "loss": losses,
    })
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    log(f"saved {out} (model.safetensors sha256 {digest[:16]})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, help=f"output folder (default golden/models/{FOLDER})")
    args = ap.parse_args()
    if args.steps < 1:
        die("--steps must be positive")
    if not os.environ.get("LD_PRELOAD"):
        log("warning: no OpenBLAS preloaded (use train.sh); training will be slower")
    train(args.steps, (args.out or MODELS / FOLDER).resolve())


if __name__ == "__main__":
    main()
