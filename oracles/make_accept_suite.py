"""Writes golden/accept/*.toml: the acceptance suites `verity accept` runs, with mlx-lm's own
acceptance on the same prompts recorded alongside for comparison.

Each suite names a target, a draft source, the num_draft_tokens values, max_tokens, and the
prompts as token ids (the 8 held-out prompts of corpus.eval_prompts: chat prompts with the chat
template applied). `[oracle]` holds mlx-lm's greedy from_draft fraction (accepted / emitted) per
k, measured here with stream_generate.

    oracles/.venv/bin/python oracles/make_accept_suite.py
"""

import common  # noqa: F401  (offline guard first)

import corpus
from common import GOLDEN, log, model_dir, write_text
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

MAX_TOKENS = 96

SUITES = {
    "trained-pair": {"draft": "qwen3-draft", "ks": [1, 2, 3, 4, 5, 6]},
    "noisy-draft": {"draft": "qwen3-target-noise0.3", "ks": [3]},
}


def prompt_ids(tok):
    _, held = corpus.split(corpus.load_sources())
    out = []
    for p in corpus.eval_prompts(held):
        if p["kind"] == "chat":
            out.append(tok.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True))
        else:
            out.append(tok.encode(p["text"], add_special_tokens=False))
    return [list(map(int, ids)) for ids in out]


def from_draft_fraction(target, tok, draft, k, prompts):
    emitted = accepted = 0
    for ids in prompts:
        out = list(stream_generate(target, tok, ids, max_tokens=MAX_TOKENS, sampler=make_sampler(temp=0.0),
                                   draft_model=draft, num_draft_tokens=k))
        emitted += len(out)
        accepted += sum(r.from_draft for r in out)
    return accepted / emitted


def main():
    target, tok = load(str(model_dir("qwen3-target")))
    prompts = prompt_ids(tok)
    out_dir = GOLDEN / "accept"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, suite in SUITES.items():
        draft = load(str(model_dir(suite["draft"])))[0]
        fractions = {k: from_draft_fraction(target, tok, draft, k, prompts) for k in suite["ks"]}
        log(f"{name}: mlx-lm from_draft " + ", ".join(f"k={k} {v:.4f}" for k, v in fractions.items()))
        lines = [
            f"# Acceptance suite for `verity accept`, written by oracles/make_accept_suite.py.",
            'format = "verity-accept/1"',
            'target = "golden/models/qwen3-target"',
            f'source = {{ kind = "model", model = "golden/models/{suite["draft"]}" }}',
            f"num_draft_tokens = {suite['ks']}",
            f"max_tokens = {MAX_TOKENS}",
            "prompts = [",
            *[f"  {ids}," for ids in prompts],
            "]",
            "",
            "# mlx-lm's greedy from_draft fraction (accepted / emitted) on the same prompts, per k.",
            "[oracle.from_draft]",
            *[f'"{k}" = {v!r}' for k, v in fractions.items()],
        ]
        write_text(out_dir / f"{name}.toml", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
