"""Writes golden/accept/*.toml: the acceptance suites `verity accept` runs, with mlx-lm's own
acceptance on the same prompts recorded alongside for comparison.

Each suite names a target, a draft source, the num_draft_tokens values, max_tokens, and the
prompts as token ids (the 8 held-out prompts of corpus.eval_prompts: chat prompts with the chat
template applied). `[oracle]` holds the oracle's greedy from_draft fraction (accepted / emitted)
per k on the same prompts: mlx-lm's stream_generate with the draft model, or for the `mtp` suite
(the qwen3_5 fixture's own MTP head) mlx-vlm's MTP loop at block size k + 1, and for
`dflash-qwen3_5` mlx-vlm's DFlash loop with the qwen3_5-dflash drafter at block ceiling k + 1.
The `mtp-trained` suite is the `mtp` suite on the trained sibling qwen3_5-trained (train_mtp.py);
its `[oracle]` also has mlx-vlm's acceptance per draft position, from the same runs: per round the
drafter records draft_lens (bs - 1 drafts, fewer when the token budget cuts the block) and
accept_lens (the accepted prefix); summed over the prompts, drafted_by_pos[i] = rounds that
drafted position i + 1, accepted_by_pos[i] = rounds that accepted it (accept_len > i), the
counters `verity accept` keeps, and per_position[i] = accepted_by_pos[i] / drafted_by_pos[i].
The `dflash` suite (qwen3-target with its DFlash drafter) has no oracle: mlx-vlm's qwen3 model
cannot hand a drafter its hidden states; `dflash-chain` runs the same drafter as a chain (one
pass per draft), the block-vs-chain probe.

    oracles/.venv/bin/python oracles/make_accept_suite.py [SUITE]...
"""

import sys

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


MTP_KS = [1, 2, 3]
DFLASH_KS = [3, 7]


def vlm_from_draft_fraction(k, prompts, kind, drafter_name, target="qwen3_5", by_pos=None):
    """mlx-vlm's speculative loop of `kind` on the fixture `target` with the drafter folder
    `drafter_name` at block size (ceiling) k + 1: emitted drafts / emitted. A draft mlx-vlm
    accepts past a stopping EOS is counted in its accept_lens but never emitted, so the emitted
    drafts are counted as the traces' from_draft flags are (record_vlm.from_draft_flags). With a
    dict `by_pos`, also stores (drafted_by_pos, accepted_by_pos) of these runs under k (those
    count every accepted draft, as verity's counters do)."""
    import mlx.core as mx
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.speculative.drafters import load_drafter
    from record_vlm import from_draft_flags

    model, processor = vlm_load(str(model_dir(target)))
    drafter, kind = load_drafter(str(model_dir(drafter_name)), kind=kind)
    emitted = accepted = 0
    drafted_at, accepted_at = [0] * k, [0] * k
    for ids in prompts:
        final = list(vlm_stream(model, processor, "", input_ids=mx.array([ids]), max_tokens=MAX_TOKENS,
                                temperature=0.0, draft_model=drafter, draft_kind=kind,
                                draft_block_size=k + 1))[-1]
        emitted += len(final.token_ids)
        accepted += sum(from_draft_flags(drafter.accept_lens, len(final.token_ids)))
        if len(drafter.draft_lens) != len(drafter.accept_lens):
            common.die(f"{target} k={k}: {len(drafter.draft_lens)} draft_lens for {len(drafter.accept_lens)} rounds")
        for d, a in zip(drafter.draft_lens, drafter.accept_lens):
            for i in range(d):
                drafted_at[i] += 1
                accepted_at[i] += int(i < a)
    if by_pos is not None:
        by_pos[k] = (drafted_at, accepted_at)
    return accepted / emitted


def write_suite(name, target, source, ks, prompts, oracle, fractions, by_pos=None):
    if fractions:
        log(f"{name}: {oracle} from_draft " + ", ".join(f"k={k} {v:.4f}" for k, v in fractions.items()))
    lines = [
        f"# Acceptance suite for `verity accept`, written by oracles/make_accept_suite.py.",
        'format = "verity-accept/1"',
        f'target = "golden/models/{target}"',
        f"source = {source}",
        f"num_draft_tokens = {ks}",
        f"max_tokens = {MAX_TOKENS}",
        "prompts = [",
        *[f"  {ids}," for ids in prompts],
        "]",
    ]
    if fractions:
        lines += [
            "",
            f"# {oracle}'s greedy from_draft fraction (accepted / emitted) on the same prompts, per k.",
            "[oracle.from_draft]",
            *[f'"{k}" = {v!r}' for k, v in fractions.items()],
        ]
    else:
        lines += ["", f"# No oracle: {oracle}."]
    if by_pos:
        lines += [
            "",
            f"# {oracle}'s rounds per draft position (0-based), summed over the prompts: drafted_by_pos[i]",
            "# counts the rounds that drafted position i (its draft_lens > i), accepted_by_pos[i] those",
            "# that accepted it (its accept_lens > i); per_position[i] = accepted_by_pos[i] / drafted_by_pos[i].",
            "[oracle.drafted_by_pos]",
            *[f'"{k}" = {d}' for k, (d, _) in by_pos.items()],
            "",
            "[oracle.accepted_by_pos]",
            *[f'"{k}" = {a}' for k, (_, a) in by_pos.items()],
            "",
            "[oracle.per_position]",
            *[f'"{k}" = {[a_i / d_i if d_i else 0.0 for d_i, a_i in zip(d, a)]!r}' for k, (d, a) in by_pos.items()],
        ]
    out_dir = GOLDEN / "accept"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / f"{name}.toml", "\n".join(lines) + "\n")


def main():
    only = set(sys.argv[1:])
    known = set(SUITES) | {"mtp", "mtp-trained", "dflash", "dflash-chain", "dflash-qwen3_5"}
    if only - known:
        common.die(f"unknown suites {sorted(only - known)}; known: {sorted(known)}")
    target, tok = load(str(model_dir("qwen3-target")))
    prompts = prompt_ids(tok)
    for name, suite in SUITES.items():
        if only and name not in only:
            continue
        draft = load(str(model_dir(suite["draft"])))[0]
        fractions = {k: from_draft_fraction(target, tok, draft, k, prompts) for k in suite["ks"]}
        source = f'{{ kind = "model", model = "golden/models/{suite["draft"]}" }}'
        write_suite(name, "qwen3-target", source, suite["ks"], prompts, "mlx-lm", fractions)
    if not only or "mtp" in only:
        # The fixtures share one tokenizer, so the prompts are the same ids.
        fractions = {k: vlm_from_draft_fraction(k, prompts, "mtp", "qwen3_5") for k in MTP_KS}
        write_suite("mtp", "qwen3_5", '{ kind = "mtp" }', MTP_KS, prompts, "mlx-vlm", fractions)
    if not only or "mtp-trained" in only:
        by_pos = {}
        fractions = {k: vlm_from_draft_fraction(k, prompts, "mtp", "qwen3_5-trained", "qwen3_5-trained", by_pos)
                     for k in MTP_KS}
        for k, (d, a) in by_pos.items():
            log(f"mtp-trained: k={k} mlx-vlm accepted by position {a} of {d}")
        write_suite("mtp-trained", "qwen3_5-trained", '{ kind = "mtp" }', MTP_KS, prompts, "mlx-vlm",
                    fractions, by_pos)
    if not only or "dflash-qwen3_5" in only:
        fractions = {k: vlm_from_draft_fraction(k, prompts, "dflash", "qwen3_5-dflash") for k in DFLASH_KS}
        source = '{ kind = "dflash", model = "golden/models/qwen3_5-dflash" }'
        write_suite("dflash-qwen3_5", "qwen3_5", source, DFLASH_KS, prompts, "mlx-vlm", fractions)
    for name, chain in [("dflash", "false"), ("dflash-chain", "true")]:
        if not only or name in only:
            source = f'{{ kind = "dflash", model = "golden/models/qwen3-target-dflash", chain = {chain} }}'
            write_suite(name, "qwen3-target", source, DFLASH_KS, prompts,
                        "mlx-vlm's qwen3 model cannot hand a drafter its hidden states", {})


if __name__ == "__main__":
    main()
