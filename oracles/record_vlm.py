"""Records golden traces (verity-trace/1) with mlx-vlm: plain greedy generation, its native MTP
speculative loop and its DFlash block-drafter loop on the qwen3_5 fixture, and the plain and MTP
cases on its trained sibling qwen3_5-trained (oracles/train_mtp.py).

Reads the [[vlm_group]] tables of golden/MANIFEST.toml (models x block sizes x prompts; block
size 0 is plain generation) and writes golden/traces/<model>/vlm-<plain|mtpN|dflashN>/<prompt>.json
with oracle.tool = "mlx-vlm". Each case runs through mlx_vlm.generate.stream_generate, the
speculative ones with the checkpoint's own MTP head split off by
mlx_vlm.speculative.drafters.load_drafter(kind="mtp"), or, in a group that names
`drafter = "<folder under golden/models>"`, with that DFlash drafter (load_drafter(kind="dflash");
N is then mlx-vlm's draft_block_size, the ceiling of the block it adapts per round), or, when the
folder's model_type is gemma4_assistant, with that Gemma 4 assistant in the MTP loop
(load_drafter(kind="mtp"); traces under vlm-assistant<N>/, their draft
{"kind": "mtp", "block_size": N, "model": <the folder>}, each round's drafts as `mtp_drafts`).
A target is asked for its MTP head only when a group records MTP runs on it, so a DFlash group
may name a target without one (qwen3_5-4bit).

mlx-vlm's speculative loop reports logprobs for the first token only (mlx_vlm/speculative/
utils.py, run_speculative_rounds yields (token, None) afterwards), so an MTP trace takes its
per-step logprobs from the plain mlx-vlm run of the same case, after checking that the two
emitted the same tokens (mlx-vlm's own speculative == plain claim); its from_draft flags come
from the drafter's per-round accept_lens, and `mtp_drafts` (a field the harness ignores) lists
each round's draft tokens as the drafter's draft_block returned them, so a test can compare
verity's drafts with mlx-vlm's round by round. A DFlash trace lists them as `dflash_drafts`: the
greedy loop calls the drafter's draft_block_greedy, the sampled one its draft_block, whose blocks
are recorded (one list of block - 1 drafts per round, so the adapted block sizes show). Traces this script owns (oracle.tool "mlx-vlm") that
it did not write this run are deleted.

A group with `temp` and `seed` samples: mlx-vlm then picks its positioned sampler
(mlx_vlm/generate/ar.py:292-305, `_PositionedTargetSampler`: generated position p draws with
key(_position_seed(seed, 0, p))), its MTP loop drafts greedily and samples the target at each
verified position (speculative/mtp.py:785, 289-313), so speculative and plain runs sample the
same tokens. Its DFlash loop samples the drafts too, from the drafter's logits with the key of
the position each proposes (speculative/dflash.py:351-362, `_PositionedDraftSampler`), and
accepts a draft when it equals the target's sample there. Such traces carry `"keys":
"positioned"` in their params and live under vlm-<plain|mtpN|dflashN>-seed<seed>/ (with
`-topp<P>` appended when the group gives `top_p`). `top_k` and `top_p` may be given (applied per
position, top-p as `top_p_sampling` writes it); the other filters make mlx-vlm fall back to its
global key sequence, which no trace records.

    oracles/.venv/bin/python oracles/record_vlm.py [--only SUBSTRING]...

Recording is deterministic: rerunning leaves `git status` clean.
"""

import argparse
import sys
import tomllib

import common  # noqa: F401  (first: the offline environment)
from common import GOLDEN, REPO, read_json, write_text

import mlx.core as mx
import mlx_vlm
from mlx_vlm import load
from mlx_vlm.generate import stream_generate
from mlx_vlm.speculative.drafters import load_drafter

from record import DEFAULTS, PROCESSOR_KEYS, SAMPLER_KEYS, ManifestError, dumps, top_entries, vlm_owned

TOOL = "mlx-vlm"


def expand(manifest):
    """One case per (vlm_group, model, block size, prompt), validated."""
    prompts = manifest.get("prompts", {})
    seen = set()
    for g, group in enumerate(manifest.get("vlm_group", [])):
        for key in ("suite", "models", "block_sizes", "prompts", "max_tokens", "tier"):
            if key not in group:
                raise ManifestError(f"vlm_group #{g + 1} lacks '{key}'")
        if group["tier"] == "B" and not (group.get("reason") and group.get("logprob_tolerance")):
            raise ManifestError(f"vlm_group #{g + 1}: tier B needs a reason and a logprob_tolerance")
        drafter = group.get("drafter")
        if ("temp" in group) != ("seed" in group):
            raise ManifestError(f"vlm_group #{g + 1}: give both temp and seed, or neither")
        if sampling(group) and not (group["temp"] > 0 and isinstance(group["seed"], int) and group["seed"] >= 0):
            raise ManifestError(f"vlm_group #{g + 1}: temp must be > 0 and seed an integer >= 0")
        for key in ("top_k", "top_p"):
            if key in group and not sampling(group):
                raise ManifestError(f"vlm_group #{g + 1}: {key} without temp and seed")
        if "top_p" in group and not 0 < group["top_p"] < 1:
            raise ManifestError(f"vlm_group #{g + 1}: top_p must be within (0, 1)")
        assistant = bool(drafter) and is_assistant(drafter)
        for model in group["models"]:
            for bs in group["block_sizes"]:
                if bs != 0 and not 2 <= bs <= 257:
                    raise ManifestError(f"vlm_group #{g + 1}: block size {bs} is not 0 (plain) or within [2, 257]")
                if drafter and bs == 0:
                    raise ManifestError(f"vlm_group #{g + 1}: a drafter group records no plain runs (block size 0)")
                variant = ("vlm-plain" if bs == 0 else f"vlm-assistant{bs}" if assistant
                           else f"vlm-dflash{bs}" if drafter else f"vlm-mtp{bs}")
                if sampling(group):
                    variant += f"-seed{group['seed']}"
                if "top_p" in group:
                    variant += f"-topp{group['top_p']}"
                for pname in group["prompts"]:
                    if pname not in prompts:
                        raise ManifestError(f"vlm_group #{g + 1}: unknown prompt '{pname}'")
                    check_prompt(pname, prompts[pname])
                    case_id = f"{model}/{variant}/{pname}"
                    if case_id in seen:
                        raise ManifestError(f"case {case_id} appears twice")
                    seen.add(case_id)
                    yield {"id": case_id, "suite": group["suite"], "model": model, "block_size": bs,
                           "prompt_name": pname, "prompt": prompts[pname], "group": group,
                           "drafter": drafter, "assistant": assistant}


def is_assistant(name):
    """Whether a drafter folder holds a Gemma 4 assistant (mlx-vlm runs it in its MTP loop)."""
    path = GOLDEN / "models" / name / "config.json"
    if not path.is_file():
        raise ManifestError(f"drafter folder {path.parent} has no config.json")
    return read_json(path).get("model_type") == "gemma4_assistant"


def check_prompt(name, prompt):
    """A prompt is `text` (with `chat` for a one-turn chat) or a multi-turn chat's `messages`:
    system or user first, then user and assistant turns in order, ending with the user's."""
    if ("text" in prompt) == ("messages" in prompt):
        raise ManifestError(f"prompt '{name}': give text or messages, not both or neither")
    if "text" in prompt:
        return
    roles = [m.get("role") for m in prompt["messages"]]
    if any(set(m) != {"role", "content"} or not isinstance(m["content"], str) for m in prompt["messages"]):
        raise ManifestError(f"prompt '{name}': each message is a role and a string content")
    turns = roles[1:] if roles[:1] == ["system"] else roles
    if not turns or turns != ["user", "assistant"] * (len(turns) // 2) + ["user"]:
        raise ManifestError(f"prompt '{name}': roles {roles} do not alternate user/assistant ending with user")


def sampling(group):
    """Whether a group samples (mlx-vlm's positioned sampler) rather than decoding greedily."""
    return "seed" in group


def sampling_kwargs(group):
    """stream_generate's sampling arguments for a group (greedy when it names no seed)."""
    if not sampling(group):
        return {"temperature": 0.0}
    return {"temperature": group["temp"], "seed": group["seed"], "top_k": group.get("top_k", 0),
            **({"top_p": group["top_p"]} if "top_p" in group else {})}


class Models:
    """Each fixture loaded once, its MTP drafter when first asked for; each DFlash drafter loaded
    once per target: mlx-vlm's DFlashDraftModel.bind keeps the embedding of the first target it
    is bound to (speculative/drafters/qwen3_dflash/dflash.py:190-229), so a drafter object shared
    by two targets would embed the second target's tokens with the first one's table."""

    def __init__(self):
        self.cache, self.drafters = {}, {}

    def drafter(self, name, kind, target):
        """A drafter folder loaded once per target: a DFlash drafter, or a Gemma 4 assistant
        (kind mtp)."""
        if (name, target) not in self.drafters:
            path = GOLDEN / "models" / name
            if not (path / "config.json").is_file():
                raise ManifestError(f"drafter folder {path} has no config.json")
            self.drafters[name, target] = load_drafter(str(path), kind=kind)
        return self.drafters[name, target]

    def get(self, name):
        """A fixture and its processor, loaded once."""
        if name not in self.cache:
            path = GOLDEN / "models" / name
            if not (path / "config.json").is_file():
                raise ManifestError(f"model folder {path} has no config.json")
            self.cache[name] = load(str(path))
        return self.cache[name]

    def own_mtp(self, name):
        """The fixture's own MTP head, split off by load_drafter (loaded once)."""
        key = ("mtp", name)
        if key not in self.drafters:
            self.drafters[key] = load_drafter(str(GOLDEN / "models" / name), kind="mtp")
        return self.drafters[key]


def prompt_tokens(tokenizer, prompt):
    """The rendered chat template (or None) and the token ids, as record.py builds them; a
    prompt with `messages` is a multi-turn chat rendered whole."""
    if "messages" in prompt:
        return chat_tokens(tokenizer, prompt["messages"])
    text = prompt["text"]
    if prompt.get("chat", False):
        return chat_tokens(tokenizer, [{"role": "user", "content": text}])
    return None, tokenizer.encode(text, add_special_tokens=True)


def chat_tokens(tokenizer, messages):
    """The chat template over `messages` with the generation prompt, and its token ids."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return rendered, tokenizer.encode(rendered, add_special_tokens=False)


def run(model, processor, tokens, max_tokens, **kwargs):
    """One stream_generate run: the per-token results and the final summary (which repeats the
    last token and carries the whole generation in token_ids, mlx_vlm/generate/dispatch.py)."""
    results = list(stream_generate(model, processor, "", input_ids=mx.array([tokens]),
                                   max_tokens=max_tokens, **kwargs))
    return results[:-1], results[-1]


def from_draft_flags(accept_lens, n):
    """The first token comes from the prefill; each round emits its accepted drafts, then the
    target's token (cut at the budget)."""
    flags = [False]
    for a in accept_lens:
        flags += [True] * a + [False]
    return flags[:n]


def prompt_field(prompt, tokens, rendered):
    """The trace's prompt: a multi-turn chat keeps its messages, its last one as the text."""
    if "messages" in prompt:
        return {"tokens": [int(t) for t in tokens], "text": prompt["messages"][-1]["content"],
                "chat": True, "rendered": rendered, "messages": prompt["messages"]}
    return {"tokens": [int(t) for t in tokens], "text": prompt["text"],
            "chat": bool(prompt.get("chat", False)), "rendered": rendered}


def record_case(case, models, plain_runs):
    group = case["group"]
    model, processor = models.get(case["model"])
    tokenizer = processor.tokenizer
    rendered, tokens = prompt_tokens(tokenizer, case["prompt"])
    max_tokens = group["max_tokens"]
    sample_kw = sampling_kwargs(group)
    key = (case["model"], case["prompt_name"], tuple(sorted(sample_kw.items())))
    if key not in plain_runs:
        plain_runs[key] = run(model, processor, tokens, max_tokens, **sample_kw)
    results, final = plain_runs[key]
    generated = final.token_ids
    flags = [False] * len(generated)
    draft, drafts = None, []
    if case["block_size"]:
        bs = case["block_size"]
        # The greedy DFlash loop calls draft_block_greedy (mlx_vlm/speculative/dflash.py), the
        # sampled one and the MTP loop draft_block: wrap the one that runs, so each round's drafts
        # are recorded once.
        method = "draft_block"
        if case["assistant"]:
            drafter, kind = models.drafter(case["drafter"], "mtp", case["model"])
        elif case["drafter"]:
            drafter, kind = models.drafter(case["drafter"], "dflash", case["model"])
            if not sampling(group):
                method = "draft_block_greedy"
        else:
            drafter, kind = models.own_mtp(case["model"])
        drafts, draft_fn = [], getattr(drafter, method)

        def recording_draft_block(*args, **kwargs):
            out = draft_fn(*args, **kwargs)
            drafts.append([int(t) for t in out.reshape(-1).tolist()])
            return out

        setattr(drafter, method, recording_draft_block)
        if case["assistant"] and sampling(group):
            # The assistant's sampled drafts draw from MLX's global key (the positioned
            # sampler's plain __call__), which stream_generate leaves unseeded; seed it as
            # mlx_vlm.generate's command line does (generate/dispatch.py), or they vary by run.
            mx.random.seed(group["seed"])
        try:
            _, spec_final = run(model, processor, tokens, max_tokens, draft_model=drafter,
                                draft_kind=kind, draft_block_size=bs, **sample_kw)
        finally:
            delattr(drafter, method)
        if spec_final.token_ids != generated:
            raise ManifestError(f"{case['id']}: mlx-vlm's {kind} run emitted other tokens than its plain run")
        flags = from_draft_flags(drafter.accept_lens, len(generated))
        draft = ({"kind": "mtp", "block_size": bs, "model": f"golden/models/{case['drafter']}"}
                 if case["assistant"] else
                 {"kind": "dflash", "model": f"golden/models/{case['drafter']}", "block_size": bs}
                 if case["drafter"] else {"kind": "mtp", "block_size": bs})
        if len(drafts) != len(drafter.accept_lens):
            raise ManifestError(f"{case['id']}: {len(drafts)} draft blocks for {len(drafter.accept_lens)} rounds")
    # A stopping EOS is not yielded on its own: it is only in the summary's token_ids.
    logprobs = [r.logprobs for r in results]
    if len(logprobs) == len(generated) - 1 and final.finish_reason == "stop":
        logprobs.append(final.logprobs)
    if len(logprobs) != len(generated):
        raise ManifestError(f"{case['id']}: {len(logprobs)} logprob rows for {len(generated)} tokens")
    steps = [{"token": int(t), "logprob": float(lp[t].astype(mx.float32).item()),
              "top": top_entries(lp), "from_draft": f}
             for t, lp, f in zip(generated, logprobs, flags)]
    eos = sorted(int(t) for t in tokenizer.stopping_criteria.eos_token_ids)
    # The sampler, written with mlx-lm's argument names as every trace is.
    sampler = {k: DEFAULTS[k] for k in sorted(SAMPLER_KEYS)}
    sampler["xtc_special_tokens"] = tokenizer.encode("\n") + eos
    if sampling(group):
        sampler["temp"], sampler["top_k"] = group["temp"], group.get("top_k", 0)
        sampler["top_p"] = group.get("top_p", DEFAULTS["top_p"])
    return {
        "format": "verity-trace/1",
        "id": case["id"],
        "suite": case["suite"],
        "oracle": {"tool": TOOL, "tool_version": mlx_vlm.__version__,
                   "mlx_version": mx.__version__, "device": "cpu"},
        "model": f"golden/models/{case['model']}",
        "draft": draft,
        "prompt_cache": None,
        "prompt": prompt_field(case["prompt"], tokens, rendered),
        "params": {
            "max_tokens": max_tokens, "seed": group.get("seed"),
            **({"keys": "positioned"} if sampling(group) else {}), "sampler": sampler,
            "processors": {k: DEFAULTS[k] for k in sorted(PROCESSOR_KEYS)},
            "prefill_step_size": 2048, "max_kv_size": None, "kv_bits": None, "kv_group_size": 64,
            "quantized_kv_start": 5000,
        },
        "parity": {"tier": group["tier"], "logprob_tolerance": group.get("logprob_tolerance"),
                   "reason": group.get("reason")},
        "eos_token_ids": eos,
        "steps": steps,
        "finish_reason": final.finish_reason,
        "generation_tokens": len(generated),
        "text": tokenizer.decode(generated),
        **({"dflash_drafts" if case["drafter"] and not case["assistant"] else "mtp_drafts": drafts}
           if case["block_size"] else {}),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="record only cases whose id contains this (repeatable)")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    out_dir = GOLDEN / "traces"
    manifest = tomllib.loads((GOLDEN / "MANIFEST.toml").read_text())
    cases = [c for c in expand(manifest) if not args.only or any(o in c["id"] for o in args.only)]
    models, plain_runs, written = Models(), {}, set()
    for case in cases:
        trace = record_case(case, models, plain_runs)
        path = out_dir / f"{case['id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, dumps(trace))
        written.add(path)
        accepted = sum(s["from_draft"] for s in trace["steps"])
        source = ("the assistant" if case["assistant"] else "the DFlash drafter" if case["drafter"]
                  else "the MTP head")
        print(f"{case['id']}: {trace['generation_tokens']} tokens, {accepted} from {source}", flush=True)
    stale = [] if args.only else [p for p in out_dir.rglob("*.json") if p not in written and vlm_owned(p)]
    for p in stale:
        p.unlink()
    print(f"recorded {len(cases)} mlx-vlm traces into {out_dir.relative_to(REPO)}, removed {len(stale)} stale")


if __name__ == "__main__":
    try:
        main()
    except ManifestError as e:
        sys.exit(f"error: {e}")
