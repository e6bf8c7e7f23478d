"""Time mlx-lm's plain against its speculative greedy decoding of one pair, alone.

`generate_step` against `speculative_generate_step` at k = 1..3 on one code prompt (greedy,
--max-tokens tokens, after one warm-up of each), alternated --reps times in one process: tok/s,
how many emitted tokens came from the draft, and whether the tokens equal plain decoding's
(exit 1 if not). What speculation can give on a device before any engine: on a GPU a step of a
tiny model costs its kernel launches, so a draft barely cheaper than its target cannot pay.

Usage: spec_speed.py TARGET DRAFT [--max-tokens 256] [--reps 3]   (model folders, local)
"""

import common  # noqa: F401  (offline guard first)

import argparse
import sys
import time
from pathlib import Path

from common import die, loadable

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.max_tokens < 1 or args.reps < 1:
        die(f"--max-tokens {args.max_tokens} and --reps {args.reps} must be at least 1")
    for name, folder in (("TARGET", args.target), ("DRAFT", args.draft)):
        if not (folder / "config.json").is_file():
            die(f"{name} {folder} is not a model folder (no config.json)")
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step

    model, tok = load(str(loadable(args.target)))
    draft, _ = load(str(loadable(args.draft)))
    prompt = mx.array(tok.encode(PROMPT))

    def plain():
        return [t for t, _ in generate_step(prompt, model, max_tokens=args.max_tokens)]

    def spec(k):
        out = list(speculative_generate_step(prompt, model, draft, num_draft_tokens=k,
                                             max_tokens=args.max_tokens))
        return [t for t, _, _ in out], sum(1 for *_, from_draft in out if from_draft)

    plain()
    spec(3)
    differs = False
    for rep in range(args.reps):
        start = time.perf_counter()
        want = plain()
        row = [f"plain {len(want) / (time.perf_counter() - start):8.1f} tok/s"]
        for k in (1, 2, 3):
            start = time.perf_counter()
            got, from_draft = spec(k)
            rate = len(got) / (time.perf_counter() - start)
            differs |= got != want
            row.append(f"k={k} {rate:8.1f} tok/s ({from_draft}/{len(got)} from the draft, "
                       f"{'same as plain' if got == want else 'DIFFERS from plain'})")
        print(f"rep {rep}: " + "; ".join(row), flush=True)
    sys.exit(1 if differs else 0)


if __name__ == "__main__":
    main()
