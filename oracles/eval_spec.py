"""Measure mlx-lm speculative acceptance on the trained fixtures and check spec == plain greedy.

Acceptance = fraction of emitted tokens with from_draft=True (mlx_lm's GenerationResponse), greedy,
over the 8 held-out prompts of corpus.eval_prompts x 96 tokens (chat prompts get the chat
template). Pairs: target + trained draft at k = 1..6, target + each noisy copy at k = 3, and the
4-bit target + 4-bit draft at k = 3. Every speculative run must be token-identical to plain greedy
(exit 1 otherwise). Prints a markdown table for oracles/README.md and a few quality numbers
(distinct 4-gram ratio, finish reasons, one sample).

Usage: eval_spec.py [--max-tokens 96]
"""

import common  # noqa: F401  (offline guard first)

import argparse
import sys
import time

import corpus
from common import log, model_dir


def run(model, tok, prompt_ids, max_tokens, draft=None, k=None):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    kw = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    out = list(stream_generate(model, tok, prompt_ids, max_tokens=max_tokens,
                               sampler=make_sampler(temp=0.0), **kw))
    return [r.token for r in out], [r.from_draft for r in out], out[-1].finish_reason


def distinct4(seqs) -> float:
    grams = [tuple(s[i:i + 4]) for s in seqs for i in range(len(s) - 3)]
    return len(set(grams)) / max(1, len(grams))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    from mlx_lm import load

    target, tok = load(str(model_dir("qwen3-target")))
    _, held = corpus.split(corpus.load_sources())
    prompts = []
    for p in corpus.eval_prompts(held):
        if p["kind"] == "chat":
            prompts.append(tok.apply_chat_template([{"role": "user", "content": p["text"]}],
                                                   add_generation_prompt=True))
        else:
            prompts.append(tok.encode(p["text"], add_special_tokens=False))

    t0 = time.monotonic()
    plain = [run(target, tok, ids, args.max_tokens) for ids in prompts]
    plain_s = time.monotonic() - t0
    n_tok = sum(len(t) for t, _, _ in plain)
    log(f"plain greedy: {n_tok} tokens in {plain_s:.1f} s; finish reasons "
        f"{[f for _, _, f in plain]}; distinct-4gram ratio {distinct4([t for t, _, _ in plain]):.2f}")
    log("sample (chat): " + repr(tok.decode(plain[-1][0])))
    log("sample (code): " + repr(tok.decode(plain[0][0])[:200]))

    pairs = [("qwen3-draft", k) for k in range(1, 7)]
    pairs += [(f"qwen3-target-noise{s}", 3) for s in (0.1, 0.3, 1.0)]
    drafts, rows, bad = {}, {}, []
    for name, k in pairs:
        if name not in drafts:
            drafts[name] = load(str(model_dir(name)))[0]
        emitted = accepted = 0
        for ids, (want, _, _) in zip(prompts, plain):
            got, from_draft, _ = run(target, tok, ids, args.max_tokens, drafts[name], k)
            if got != want:
                bad.append(f"{name} k={k}")
            emitted += len(got)
            accepted += sum(from_draft)
        rows[(name, k)] = accepted / emitted
        log(f"target + {name:22s} k={k}: from_draft {accepted}/{emitted} = {rows[(name, k)]:.3f}")

    target4, tok4 = load(str(model_dir("qwen3-target-4bit")))
    draft4 = load(str(model_dir("qwen3-draft-4bit")))[0]
    emitted = accepted = 0
    for ids in prompts:
        want, _, _ = run(target4, tok4, ids, args.max_tokens)
        got, from_draft, _ = run(target4, tok4, ids, args.max_tokens, draft4, 3)
        bad += ["4bit k=3"] if got != want else []
        emitted, accepted = emitted + len(got), accepted + sum(from_draft)
    log(f"target-4bit + draft-4bit k=3: from_draft {accepted}/{emitted} = {accepted / emitted:.3f}")

    print("\n| draft | " + " | ".join(f"k={k}" for k in range(1, 7)) + " |")
    print("|---|" + "---|" * 6)
    print("| qwen3-draft | " + " | ".join(f"{rows[('qwen3-draft', k)]:.3f}" for k in range(1, 7)) + " |")
    for s in (0.1, 0.3, 1.0):
        name = f"qwen3-target-noise{s}"
        print(f"| {name} | | | {rows[(name, 3)]:.3f} | | | |")
    print(f"| qwen3-draft-4bit (target-4bit) | | | {accepted / emitted:.3f} | | | |\n")
    if bad:
        log(f"FAIL: speculative output != plain greedy for {bad}")
        sys.exit(1)
    log("every speculative run is token-identical to plain greedy")


if __name__ == "__main__":
    main()
