"""Records golden token traces (format verity-trace/1, docs/trace-format.md) with mlx-lm.

Reads golden/MANIFEST.toml, expands its groups (models x variants x prompts) into cases, runs each
through mlx_lm.stream_generate exactly as `mlx_lm.generate` would (chat template, encoding,
sampler and processor construction, seeding), and writes golden/traces/<id>.json. A group with
`batch_max_tokens` is one batch per model and variant instead: its prompts decode together
through mlx-lm's BatchGenerator (as batch_generate drives it), row i with the i-th max_tokens,
and each row's trace records the whole batch. Traces it did not write this run are deleted, so
the folder always equals the manifest.

    oracles/.venv/bin/python oracles/record.py [--only SUBSTRING]... [--device gpu] [--out DIR]

--device gpu records the set of the GPU backend this MLX has (CUDA with the mlx-cuda-13
wheel, Metal on an M-series Mac) into golden/traces-<backend>, its prompt cache files into
golden/prompt-cache-<backend>, and skips the cases golden/MANIFEST.toml lists as unsupported
on that backend. --out writes the set elsewhere (to diff a fresh recording against the
committed one). The CPU set, golden/traces, is recorded by default.

Recording is deterministic: rerunning leaves `git status` clean.
"""

import argparse
import json
import math
import os
import sys
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from tqdm import tqdm

from common import loadable, write_text

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"
TOP_K = 5

SAMPLER_KEYS = {"temp", "top_p", "min_p", "min_tokens_to_keep", "top_k", "xtc_probability", "xtc_threshold"}
PROCESSOR_KEYS = {
    "logit_bias", "repetition_penalty", "repetition_context_size", "presence_penalty",
    "presence_context_size", "frequency_penalty", "frequency_context_size",
}
GENERATION_KEYS = {
    "max_tokens", "seed", "prefill_step_size", "max_kv_size", "kv_bits", "kv_group_size",
    "quantized_kv_start", "draft", "num_draft_tokens", "tier", "logprob_tolerance", "reason",
    "prompt_cache_prefix",
}
DEFAULTS = {
    "temp": 0.0, "top_p": 0.0, "min_p": 0.0, "min_tokens_to_keep": 1, "top_k": 0,
    "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "logit_bias": None, "repetition_penalty": None, "repetition_context_size": 20,
    "presence_penalty": None, "presence_context_size": 20, "frequency_penalty": None,
    "frequency_context_size": 20,
    "max_tokens": 48, "seed": None, "prefill_step_size": 2048, "max_kv_size": None,
    "kv_bits": None, "kv_group_size": 64, "quantized_kv_start": 5000, "draft": None,
    "num_draft_tokens": 3, "tier": "A", "logprob_tolerance": None, "reason": None,
    "prompt_cache_prefix": None,
}


class ManifestError(ValueError):
    pass


def expand(manifest):
    """Yields one case dict per (group, model, variant, prompt), validated."""
    if manifest.get("format") != "verity-manifest/1":
        raise ManifestError("MANIFEST.toml: format must be 'verity-manifest/1'")
    prompts, variants = manifest.get("prompts", {}), manifest.get("variants", {})
    defaults = dict(DEFAULTS, **manifest.get("defaults", {}))
    seen = set()
    for g, group in enumerate(manifest.get("group", [])):
        for key in ("suite", "models", "variants", "prompts"):
            if key not in group:
                raise ManifestError(f"group #{g + 1} lacks '{key}'")
        for model in group["models"]:
            for vname in group["variants"]:
                if vname not in variants:
                    raise ManifestError(f"group #{g + 1}: unknown variant '{vname}'")
                params = dict(defaults, **variants[vname])
                unknown = set(variants[vname]) - SAMPLER_KEYS - PROCESSOR_KEYS - GENERATION_KEYS
                if unknown:
                    raise ManifestError(f"variant '{vname}': unknown keys {sorted(unknown)}")
                if params["temp"] > 0 and params["seed"] is None:
                    raise ManifestError(f"variant '{vname}': sampling without a seed cannot be replayed")
                batch = batch_of(g, group, vname, params)
                for row, pname in enumerate(group["prompts"]):
                    if pname not in prompts:
                        raise ManifestError(f"group #{g + 1}: unknown prompt '{pname}'")
                    case_id = f"{model}/{vname}/{pname}"
                    if case_id in seen:
                        raise ManifestError(f"case {case_id} appears twice")
                    seen.add(case_id)
                    case = {"id": case_id, "suite": group["suite"], "model": model,
                            "prompt": prompts[pname], "params": params}
                    if batch:
                        case["params"] = dict(params, max_tokens=batch["max_tokens"][row])
                        case["batch"] = dict(batch, row=row,
                                             prompts=[prompts[p] for p in group["prompts"]])
                    yield case


def batch_of(g, group, vname, params):
    """A batch group's shared settings (its key, the rows' max_tokens), or None. BatchGenerator
    takes per-row samplers and processors, but batch_generate's path is greedy with neither, and
    it has no quantized KV cache or draft model: those are refused here."""
    if "batch_max_tokens" not in group:
        return None
    max_tokens = group["batch_max_tokens"]
    if len(max_tokens) != len(group["prompts"]) or min(max_tokens) < 1:
        raise ManifestError(f"group #{g + 1}: batch_max_tokens needs one count >= 1 per prompt")
    plain = {k: DEFAULTS[k] for k in SAMPLER_KEYS | PROCESSOR_KEYS | {"seed", "kv_bits", "draft",
                                                                     "prompt_cache_prefix"}}
    if any(params[k] != v for k, v in plain.items()):
        raise ManifestError(f"variant '{vname}': a batch group decodes greedy, without processors, "
                            "quantized KV, a draft or a prompt cache")
    return {"key": (g, vname), "max_tokens": max_tokens}


class Models:
    """Loads each fixture once (a whole run touches ~20 folders)."""

    def __init__(self):
        self.cache = {}

    def get(self, name):
        if name not in self.cache:
            path = GOLDEN / "models" / name
            if not (path / "config.json").is_file():
                raise ManifestError(f"model folder {path} has no config.json")
            self.cache[name] = load(str(loadable(path)))
        return self.cache[name]


def prompt_tokens(tokenizer, prompt):
    """What mlx_lm.generate's main() feeds the model (generate.py:2090-2131): the rendered chat
    template (or None for raw text) and the token ids."""
    text = prompt["text"]
    if prompt.get("chat", False):
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return rendered, tokenizer.encode(rendered, add_special_tokens=False)
    return None, tokenizer.encode(text, add_special_tokens=True)


def backend_name(device):
    """The backend traces name: "cpu", or the GPU's "cuda" / "metal"."""
    if device == "cpu":
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    raise ManifestError("--device gpu: this MLX has neither a CUDA nor a Metal backend")


def unsupported(manifest, backend, case):
    """The manifest's reason `backend` cannot run `case` (an entry's variants and models must
    each list the case's, where given), or None."""
    model, variant = case["id"].split("/")[:2]
    for u in manifest.get("unsupported", []):
        if (u["backend"] == backend and variant in u.get("variants", [variant])
                and model in u.get("models", [model])):
            return u["why"]
    return None


def cache_prefix(case, model, tokens, p, cache_dir):
    """mlx_lm.cache_prompt on the first `prompt_cache_prefix` tokens: process them with
    generate_step(max_tokens=0) and save the cache file under golden/prompt-cache/. Returns the
    trace's prompt_cache entry and the rest of the prompt, which generation then continues."""
    n = p["prompt_cache_prefix"]
    if not 0 < n < len(tokens):
        raise ManifestError(f"{case['id']}: prompt_cache_prefix must leave tokens on both sides")
    prefix, rest = tokens[:n], tokens[n:]
    cache = make_prompt_cache(model, p["max_kv_size"])
    for _ in generate_step(mx.array(prefix), model, max_tokens=0, prompt_cache=cache,
                           prefill_step_size=p["prefill_step_size"], kv_bits=p["kv_bits"],
                           kv_group_size=p["kv_group_size"], quantized_kv_start=p["quantized_kv_start"]):
        pass
    rel = cache_dir.relative_to(ROOT) / (case["id"].replace("/", "__") + ".safetensors")
    (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
    save_prompt_cache(str(ROOT / rel), cache, {"model": case["model"]})
    return {"file": str(rel), "tokens": [int(t) for t in prefix]}, rest


def top_entries(logprobs):
    """The TOP_K best (id, logprob): logprob descending, then id ascending."""
    lp = np.array(logprobs.astype(mx.float32))
    order = np.lexsort((np.arange(lp.size), -lp))[:TOP_K]
    return [[int(i), float(lp[i])] for i in order]


BATCHES = {}


def batch_rows(case, models):
    """Every row of the case's batch, decoded together once per model and variant: the rows'
    prompt tokens and, per row, its steps and finish reason."""
    b, p = case["batch"], case["params"]
    key = (b["key"], case["model"])
    if key not in BATCHES:
        model, tokenizer = models.get(case["model"])
        prompts = [prompt_tokens(tokenizer, prompt)[1] for prompt in b["prompts"]]
        gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                             prefill_step_size=p["prefill_step_size"], max_kv_size=p["max_kv_size"])
        uids = gen.insert(prompts, b["max_tokens"])
        steps, finish = {u: [] for u in uids}, {}
        while responses := gen.next_generated():
            for r in responses:
                steps[r.uid].append({"token": int(r.token),
                                     "logprob": float(r.logprobs[r.token].astype(mx.float32).item()),
                                     "top": top_entries(r.logprobs), "from_draft": False})
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
        gen.close()
        BATCHES[key] = (prompts, [(steps[u], finish[u]) for u in uids])
    return BATCHES[key]


def record_case(case, models, backend, cache_dir):
    p = case["params"]
    model, tokenizer = models.get(case["model"])
    rendered, tokens = prompt_tokens(tokenizer, case["prompt"])
    eos = sorted(tokenizer.eos_token_ids)
    xtc_special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    sampler_args = {k: p[k] for k in sorted(SAMPLER_KEYS)}
    sampler = make_sampler(**sampler_args, xtc_special_tokens=xtc_special)
    bias = {int(k): float(v) for k, v in p["logit_bias"].items()} if p["logit_bias"] else None
    processors = make_logits_processors(
        bias, p["repetition_penalty"], p["repetition_context_size"], p["presence_penalty"],
        p["presence_context_size"], p["frequency_penalty"], p["frequency_context_size"],
    )
    kwargs = dict(
        max_tokens=p["max_tokens"], sampler=sampler, logits_processors=processors,
        prefill_step_size=p["prefill_step_size"], max_kv_size=p["max_kv_size"],
        kv_bits=p["kv_bits"], kv_group_size=p["kv_group_size"],
        quantized_kv_start=p["quantized_kv_start"],
    )
    draft = None
    if p["draft"] is not None:
        draft = {"kind": "model", "model": f"golden/models/{p['draft']}",
                 "num_draft_tokens": p["num_draft_tokens"]}
        kwargs["draft_model"] = models.get(p["draft"])[0]
        kwargs["num_draft_tokens"] = p["num_draft_tokens"]
    prompt_cache = None
    if p["prompt_cache_prefix"] is not None:
        prompt_cache, tokens = cache_prefix(case, model, tokens, p, cache_dir)
        kwargs["prompt_cache"] = load_prompt_cache(str(ROOT / prompt_cache["file"]))
    if p["seed"] is not None:
        mx.random.seed(p["seed"])
    steps, finish, count, generated, batch = [], None, 0, [], None
    if "batch" in case:
        prompts, rows = batch_rows(case, models)
        steps, finish = rows[case["batch"]["row"]]
        count, generated = len(steps), [s["token"] for s in steps]
        batch = {"rows": [{"tokens": [int(t) for t in ids], "max_tokens": m}
                          for ids, m in zip(prompts, case["batch"]["max_tokens"])],
                 "row": case["batch"]["row"]}
    else:
        for r in stream_generate(model, tokenizer, tokens, **kwargs):
            steps.append({"token": int(r.token),
                          "logprob": float(r.logprobs[r.token].astype(mx.float32).item()),
                          "top": top_entries(r.logprobs), "from_draft": bool(r.from_draft)})
            generated.append(int(r.token))
            finish, count = r.finish_reason, r.generation_tokens
    trace = {
        "format": "verity-trace/1",
        "id": case["id"],
        "suite": case["suite"],
        "oracle": {"tool": "mlx-lm", "tool_version": mlx_lm.__version__,
                   "mlx_version": mx.__version__, "device": backend},
        "model": f"golden/models/{case['model']}",
        "draft": draft,
        "prompt_cache": prompt_cache,
        "prompt": {"tokens": [int(t) for t in tokens], "text": case["prompt"]["text"],
                   "chat": bool(case["prompt"].get("chat", False)), "rendered": rendered},
        "params": {
            "max_tokens": p["max_tokens"], "seed": p["seed"],
            "sampler": dict(sampler_args, xtc_special_tokens=xtc_special),
            "processors": {"logit_bias": {str(k): v for k, v in bias.items()} if bias else None,
                           **{k: p[k] for k in sorted(PROCESSOR_KEYS - {"logit_bias"})}},
            "prefill_step_size": p["prefill_step_size"], "max_kv_size": p["max_kv_size"],
            "kv_bits": p["kv_bits"], "kv_group_size": p["kv_group_size"],
            "quantized_kv_start": p["quantized_kv_start"],
        },
        "parity": {"tier": p["tier"], "logprob_tolerance": p["logprob_tolerance"], "reason": p["reason"]},
        "eos_token_ids": eos,
        "steps": steps,
        "finish_reason": finish,
        "generation_tokens": count,
        "text": tokenizer.decode(generated),
    }
    if batch is not None:
        # Only batch traces carry the field, so the others' files stay as they were recorded.
        items = list(trace.items())
        at = [k for k, _ in items].index("prompt")
        trace = dict(items[:at] + [("batch", batch)] + items[at:])
    return trace


def refuse_non_finite(case_id, trace, backend):
    """A NaN or infinite logprob is no golden (and no JSON): stop, naming the case and step
    (mlx-cuda 0.32.4 gave NaN for every logprob of gemma4-4bit under cuda-qmm-k64)."""
    for i, step in enumerate(trace["steps"]):
        values = [step["logprob"]] + [lp for _, lp in step["top"]]
        if not all(math.isfinite(v) for v in values):
            raise ManifestError(f"{case_id}: mlx-lm's logprobs at step {i} on {backend} are not "
                                f"finite ({step['logprob']}); list the case as [[unsupported]] there")


def dumps(trace):
    """Stable, reviewable JSON: objects indented, lists of scalars and steps on one line each."""

    def enc(v, pad):
        if isinstance(v, dict):
            inner = ",\n".join(f"{pad} {json.dumps(k)}: {enc(x, pad + ' ')}" for k, x in v.items())
            return "{\n" + inner + "\n" + pad + "}" if v else "{}"
        if isinstance(v, list) and any(isinstance(x, dict) for x in v):
            return "[\n" + ",\n".join(f"{pad} {json.dumps(x, ensure_ascii=False)}" for x in v) + "\n" + pad + "]"
        return json.dumps(v, ensure_ascii=False)

    return enc(trace, "") + "\n"


def vlm_owned(path):
    """Whether a file is a trace oracles/record_vlm.py wrote (oracle.tool "mlx-vlm")."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))["oracle"]["tool"] == "mlx-vlm"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append",
                    help="record only cases whose id contains this (repeatable)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="device to record on")
    ap.add_argument("--out", help="write the set (and its prompt caches) under this folder instead")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    backend = backend_name(args.device)
    suffix = "" if backend == "cpu" else f"-{backend}"
    base = Path(args.out).resolve() if args.out else GOLDEN
    out_dir, cache_dir = base / f"traces{suffix}", base / f"prompt-cache{suffix}"
    if args.out and ROOT not in out_dir.parents:
        raise ManifestError("--out must be inside the repository (traces name their files by repository path)")
    manifest = tomllib.loads((GOLDEN / "MANIFEST.toml").read_text())
    cases = [c for c in expand(manifest) if not args.only or any(o in c["id"] for o in args.only)]
    skipped = [c for c in cases if unsupported(manifest, backend, c)]
    cases = [c for c in cases if c not in skipped]
    models, written = Models(), set()
    for case in tqdm(cases, desc=f"recording traces on {backend}", unit="trace"):
        trace = record_case(case, models, backend, cache_dir)
        refuse_non_finite(case["id"], trace, backend)
        path = out_dir / f"{case['id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, dumps(trace))
        written.add(path)
        if trace["prompt_cache"]:
            written.add(ROOT / trace["prompt_cache"]["file"])
    stale = []
    if not args.only:
        files = list(out_dir.rglob("*.json")) + list(cache_dir.glob("*.safetensors"))
        # oracles/record_vlm.py owns the mlx-vlm traces.
        stale = [p for p in files if p not in written and not vlm_owned(p)]
    for p in stale:
        p.unlink()
    print(f"recorded {len(cases)} traces into {out_dir.relative_to(ROOT)} on {backend}, "
          f"skipped {len(skipped)} unsupported there, removed {len(stale)} stale")


if __name__ == "__main__":
    try:
        main()
    except ManifestError as e:
        sys.exit(f"error: {e}")
