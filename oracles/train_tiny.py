"""Train the tiny qwen3 target (~1M params) or its ~5x smaller draft on the stdlib corpus, on CPU.

Why trained fixtures: random models give meaningless speculative acceptance (docs/fixture-pitfalls.md, P13);
these two produce Python-like text and chat answers ending in <|im_end|>, so acceptance rates,
finish reasons and traces mean something. The weights are committed; CI never trains.

Data: the pinned stdlib training files plus chat pairs (rendered with the golden chat template,
4 copies), each document followed by <|endoftext|>; validation = the held-out files and their chat
pairs (corpus.split). Batches are random 128-token windows from a seeded numpy Generator.
Model: mlx_lm's qwen3 class, tied embeddings, default MLX init under a fixed seed.
Optimisation: compiled step, AdamW (wd 0.01), 50 warmup steps then cosine 3e-3 -> 1.5e-4,
grad-norm clip 1.0, batch 16 x 128, fixed step count.
Reproducible bit for bit when run through train.sh (serial OpenBLAS, one thread): same command,
same weights and training_log.json.

The -hd64 pair is the same two models at head_dim 64, which MLX's one-query attention kernels take
on CUDA (32 is not among 64/96/128, so the committed pair's GPU rows attend one call each): built
for `verity bench` on a GPU into target/bench-models, not committed (golden/ stays small).

target-deep is target-hd64 at 16 layers, and with --distil-from it draft-hd64 learns its greedy
output: a pair where speculation can pay on a GPU, whose step costs its launches (a 2-layer
draft step there costs nearly what the 4-layer target's does, docs/gpu-rows.md).

Usage: train_tiny.py {target,draft,target-hd64,draft-hd64,target-deep} [--steps N] [--out DIR]
                     [--distil-from DIR]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import hashlib
import math
import os
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import corpus
from common import MODELS, REPO, TOKENIZER, copy_tokenizer, die, fresh_dir, log, write_json

BASE = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024, head_dim=32,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
    tie_word_embeddings=True, eos_token_id=[2, 0],
)
SPECS = {  # name -> (folder, seed, config)
    "target": ("qwen3-target", 0, {**BASE, "hidden_size": 128, "num_hidden_layers": 4,
                                   "intermediate_size": 384, "num_attention_heads": 4,
                                   "num_key_value_heads": 2}),
    "draft": ("qwen3-draft", 1, {**BASE, "hidden_size": 64, "num_hidden_layers": 2,
                                 "intermediate_size": 192, "num_attention_heads": 2,
                                 "num_key_value_heads": 1}),
}
SPECS.update({  # the bench pair: same models, head_dim 64, trained the same way
    f"{which}-hd64": (f"{folder}-hd64", seed, {**cfg, "head_dim": 64})
    for which, (folder, seed, cfg) in list(SPECS.items())
})
# A target deep enough that a draft step costs a fraction of its step where a step's cost is its
# kernel launches (a GPU), for the draft-hd64 config distilled from it (--distil-from).
SPECS["target-deep"] = ("qwen3-target-deep", 0, {**SPECS["target-hd64"][2], "num_hidden_layers": 16})
BENCH = {"target-hd64", "draft-hd64", "target-deep"}
STEPS, BATCH, SEQ = 1500, 16, 128
DISTIL_PROMPT, DISTIL_SEQS, DISTIL_BATCH = 32, 4096, 256
LR, LR_END, WARMUP, WD, CLIP = 3e-3, 1.5e-4, 50, 0.01, 1.0
CHAT_COPIES = 4
EVAL_EVERY, EVAL_WINDOWS = 250, 64


def token_streams():
    """(train, val) int32 token arrays; documents separated by <|endoftext|> (id 0)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    chat = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER))

    def docs(files, copies):
        out = [text for _, text in files]
        for q, a in corpus.chat_pairs(files):
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            out += [chat.apply_chat_template(msgs, tokenize=False)] * copies
        return out

    def stream(texts):
        ids = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids += enc.ids + [0]
        return np.array(ids, dtype=np.int32)

    train, held = corpus.split(corpus.load_sources())
    return stream(docs(train, CHAT_COPIES)), stream(docs(held, 1))


def prompts_from(stream: np.ndarray, n: int, length: int, header: list[int], rng) -> np.ndarray:
    """n windows of `length` tokens: half end right after the assistant header, half anywhere."""
    h = len(header)
    ends = [i + h for i in range(length, len(stream) - h)
            if stream[i] == header[0] and list(stream[i:i + h]) == header]
    chat = rng.choice(np.array(ends), size=n // 2, replace=len(ends) < n // 2)
    anywhere = rng.integers(length, len(stream), size=n - n // 2)
    return np.stack([stream[e - length:e] for e in np.concatenate([chat, anywhere])])


def distilled(teacher: Path, train_ids: np.ndarray, seed: int) -> np.ndarray:
    """(DISTIL_SEQS, SEQ + 1) windows: prompts of DISTIL_PROMPT tokens from the training stream
    continued by `teacher`'s greedy output, which a draft trained on them learns to propose."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = load(str(teacher))
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    prompts = prompts_from(train_ids, DISTIL_SEQS, DISTIL_PROMPT, header, np.random.default_rng(seed))
    out = []
    for i in range(0, len(prompts), DISTIL_BATCH):
        cache = make_prompt_cache(model)
        y = mx.argmax(model(mx.array(prompts[i:i + DISTIL_BATCH]), cache=cache)[:, -1], axis=-1)
        made = [y]
        for _ in range(SEQ - DISTIL_PROMPT):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            made.append(y)
            mx.eval(y)
        out.append(np.concatenate([prompts[i:i + DISTIL_BATCH], np.array(mx.stack(made, axis=1))], axis=1))
    return np.concatenate(out).astype(np.int32)


def clipped_step(grad_fn, model, opt, clip: float, batch: tuple, where: str) -> float:
    """One optimiser step of `model` on `batch` (grad_fn's arguments after the model), gradients
    clipped to norm `clip`, evaluated at once: the loss as the logs keep it (5 decimals). A
    non-finite loss stops the run, naming `where`. (The fine-tuning scripts' loop; train() above
    compiles its own step.)"""
    loss, grads = grad_fn(model, *batch)
    grads, _ = optim.clip_grad_norm(grads, clip)
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state, loss)
    loss = round(float(loss), 5)
    if not math.isfinite(loss):
        die(f"{where}: loss diverged")
    return loss


def build(cfg: dict, seed: int):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    return model_cls(args_cls.from_dict(dict(cfg)))


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def train(name: str, steps: int, out: Path, teacher: Path | None = None):
    folder, seed, cfg = SPECS[name]
    log(f"{name}: tokenizing the corpus")
    train_ids, val_ids = token_streams()
    log(f"{name}: {len(train_ids)} train / {len(val_ids)} val tokens")
    windows = None
    if teacher is not None:
        log(f"{name}: {DISTIL_SEQS} greedy continuations by {teacher.name}")
        windows = distilled(teacher, train_ids, seed)
    model = build(cfg, seed)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, LR, WARMUP), optim.cosine_decay(LR, max(1, steps - WARMUP), LR_END)],
        [WARMUP])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=WD)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, CLIP)
        opt.update(model, grads)
        return loss

    val_starts = np.linspace(0, len(val_ids) - SEQ - 2, EVAL_WINDOWS).astype(np.int64)
    vx = mx.array(np.stack([val_ids[s:s + SEQ] for s in val_starts]))
    vy = mx.array(np.stack([val_ids[s + 1:s + SEQ + 1] for s in val_starts]))

    def val_loss():
        return float(loss_fn(model, vx, vy))

    rng = np.random.default_rng(seed)
    losses, evals = [], []
    log(f"{name}: {n_params / 1e3:.0f}k params, {steps} steps of {BATCH}x{SEQ}")
    for i in range(1, steps + 1):
        if windows is None:
            starts = rng.integers(0, len(train_ids) - SEQ - 1, size=BATCH)
            batch = np.stack([train_ids[s:s + SEQ + 1] for s in starts])
        else:
            batch = windows[rng.integers(0, len(windows), size=BATCH)]
        x, y = mx.array(batch[:, :-1]), mx.array(batch[:, 1:])
        loss = step(x, y)
        mx.eval(state)
        losses.append(round(float(loss), 5))
        if not math.isfinite(losses[-1]):
            die(f"{name}: loss diverged at step {i}")
        if i % EVAL_EVERY == 0 or i == steps:
            evals.append({"step": i, "val_loss": round(val_loss(), 5)})
            log(f"{name}: step {i} loss {losses[-1]:.3f} val {evals[-1]['val_loss']:.3f}")

    out = fresh_dir(out)
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", cfg)
    copy_tokenizer(out)
    write_json(out / "training_log.json", {
        "model": folder, "params": n_params, "seed": seed, "steps": steps, "batch": BATCH,
        "distilled_from": teacher.name if teacher else None,
        "seq": SEQ, "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
        "optimizer": {"name": "AdamW", "lr": LR, "lr_end": LR_END, "warmup": WARMUP,
                      "schedule": "linear warmup then cosine", "weight_decay": WD, "grad_clip": CLIP},
        "blas": os.environ.get("LD_PRELOAD", "") and Path(os.environ["LD_PRELOAD"]).name,
        "val": evals, "loss": losses,
    })
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    log(f"{name}: saved {out} (model.safetensors sha256 {digest[:16]})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", choices=sorted(SPECS))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path,
                    help="output folder (default golden/models/<name>, target/bench-models/<name> "
                         "for the bench models: -hd64, target-deep)")
    ap.add_argument("--distil-from", type=Path, metavar="DIR",
                    help="train on this model's greedy continuations of corpus prompts instead of "
                         "the corpus (a draft that proposes what its target writes)")
    args = ap.parse_args()
    if args.steps < 1:
        die("--steps must be positive")
    if args.distil_from and not (args.distil_from / "config.json").is_file():
        die(f"--distil-from {args.distil_from} is not a model folder (no config.json)")
    if not os.environ.get("LD_PRELOAD"):
        log("warning: no OpenBLAS preloaded (use train.sh); training will be ~6x slower")
    folder = SPECS[args.which][0]
    default = (REPO / "target" / "bench-models" if args.which in BENCH else MODELS) / folder
    train(args.which, args.steps, (args.out or default).resolve(), args.distil_from)


if __name__ == "__main__":
    main()
