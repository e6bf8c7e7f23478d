"""Answers a `verity judge export` requests file with mlx-lm itself (protocol verity-judge/1,
docs/judge.md), through the code paths oracles/record.py records the goldens with:
stream_generate (generate_step, or speculative_generate_step with a draft model) for a generate
request, BatchGenerator for a batch row, and generate_step with a sampler that returns the
oracle's tokens for a score request (teacher-forced: mlx-lm's own prefill, processors and KV
quantization, fed the given tokens). On the CPU every mlx-lm golden must then come out at tier A,
which shows the protocol loses nothing.

    oracles/.venv/bin/python oracles/judge_mlx_lm.py requests.jsonl responses.jsonl

Answered unsupported: the cases mlx-lm cannot run (mlx-vlm's MTP and DFlash loops, its
positioned sampler keys) and the tier C cases, whose known oracle bug is in mlx-lm itself; any
case mlx-lm raises on is answered unsupported with the error.
"""

import json
import sys

import common  # noqa: F401  (first: it keeps every oracle off the network)

import mlx.core as mx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import loadable  # noqa: E402
from judge_protocol import Unsupported, answer_all  # noqa: E402
from record import ROOT, top_entries  # noqa: E402


MODELS = {}


def model(path):
    """mlx-lm's model and tokenizer of a repository-relative folder, loaded once."""
    if path not in MODELS:
        MODELS[path] = load(str(loadable(ROOT / path)))
    return MODELS[path]


def step(token, logprobs, from_draft=False):
    return {"token": int(token), "logprob": float(logprobs[token].astype(mx.float32).item()),
            "top": top_entries(logprobs), "from_draft": bool(from_draft)}


def generation_kwargs(req, tokenizer):
    """stream_generate's arguments for the request, built as record.py builds them."""
    p = req["params"]
    bias = p["processors"]["logit_bias"]
    bias = {int(k): float(v) for k, v in bias.items()} if bias else None
    q = p["processors"]
    kwargs = dict(
        max_tokens=p["max_tokens"], sampler=make_sampler(**p["sampler"]),
        logits_processors=make_logits_processors(
            bias, q["repetition_penalty"], q["repetition_context_size"], q["presence_penalty"],
            q["presence_context_size"], q["frequency_penalty"], q["frequency_context_size"]),
        prefill_step_size=p["prefill_step_size"], max_kv_size=p["max_kv_size"],
        kv_bits=p["kv_bits"], kv_group_size=p["kv_group_size"],
        quantized_kv_start=p["quantized_kv_start"],
    )
    if req["prompt_cache"] is not None:
        kwargs["prompt_cache"] = load_prompt_cache(str(ROOT / req["prompt_cache"]["file"]))
    tokenizer.eos_token_ids = req["eos_token_ids"]
    return kwargs


BATCHES = {}


def batch_row(req):
    """The request's row of its batch, every row decoded together once through BatchGenerator
    (as record.py's batch_rows): the row's steps and finish reason."""
    b, p = req["batch"], req["params"]
    key = json.dumps([req["model"], b["rows"], p["prefill_step_size"], p["max_kv_size"]])
    if key not in BATCHES:
        m, _ = model(req["model"])
        gen = BatchGenerator(m, stop_tokens=[[t] for t in req["eos_token_ids"]],
                             prefill_step_size=p["prefill_step_size"], max_kv_size=p["max_kv_size"])
        uids = gen.insert([r["tokens"] for r in b["rows"]], [r["max_tokens"] for r in b["rows"]])
        steps, finish = {u: [] for u in uids}, {}
        while responses := gen.next_generated():
            for r in responses:
                steps[r.uid].append(step(r.token, r.logprobs))
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
        gen.close()
        BATCHES[key] = [(steps[u], finish[u]) for u in uids]
    return BATCHES[key][b["row"]]


def generate(req):
    if req["batch"] is not None:
        steps, finish = batch_row(req)
        return {"steps": steps, "finish_reason": finish}
    m, tokenizer = model(req["model"])
    kwargs = generation_kwargs(req, tokenizer)
    if req["draft"] is not None:
        kwargs["draft_model"] = model(req["draft"]["model"])[0]
        kwargs["num_draft_tokens"] = req["draft"]["num_draft_tokens"]
    if req["params"]["seed"] is not None:
        mx.random.seed(req["params"]["seed"])
    steps, finish = [], None
    for r in stream_generate(m, tokenizer, req["prompt"], **kwargs):
        steps.append(step(r.token, r.logprobs, r.from_draft))
        finish = r.finish_reason
    return {"steps": steps, "finish_reason": finish}


def forced(m, req, kwargs, on_step):
    """generate_step over the prompt with a sampler that picks the request's tokens in turn, so
    mlx-lm computes each step's logprobs on the oracle's prefix; `on_step(i, logprobs)` sees
    step i."""
    tokens = req["tokens"]
    at = 0

    def sampler(_logprobs):
        nonlocal at
        # generate_step computes one step ahead; past the last token any id will do.
        token = tokens[min(at, len(tokens) - 1)]
        at += 1
        return mx.array([token], dtype=mx.uint32)

    kwargs = dict(kwargs, max_tokens=len(tokens), sampler=sampler)
    for i, (_, logprobs) in enumerate(generate_step(mx.array(req["prompt"]), m, **kwargs)):
        on_step(i, logprobs)


def score(req):
    m, tokenizer = model(req["model"])
    kwargs = generation_kwargs(req, tokenizer)
    if "prompt_cache" not in kwargs:
        kwargs["prompt_cache"] = make_prompt_cache(m, req["params"]["max_kv_size"])
    scored = []

    def keep(i, logprobs):
        s = step(req["tokens"][i], logprobs)
        scored.append({"logprob": s["logprob"], "top": s["top"]})

    forced(m, req, kwargs, keep)
    answer = {"scored": scored}
    if req.get("draft_tokens"):
        # The draft model's greedy choice at every position, over the prompt (without any
        # prompt cache's prefix) and the oracle's tokens, as verity's replay scores it.
        d = model(req["draft"]["model"])[0]
        kwargs = dict(kwargs, prompt_cache=make_prompt_cache(d))
        choices = []
        forced(d, req, kwargs, lambda i, lp: choices.append(int(mx.argmax(lp).item())))
        answer["draft_tokens"] = choices
    return answer


def answer(req):
    draft = req["draft"] or {}
    if draft.get("kind") in ("mtp", "dflash"):
        raise Unsupported(f"mlx-lm has no {draft['kind']} drafter (an mlx-vlm loop)")
    if req["params"].get("keys", "sequence") != "sequence":
        raise Unsupported("mlx-lm keys its random draws as a sequence, not by position (mlx-vlm)")
    if req["mode"] == "tier-c":
        raise Unsupported(f"mlx-lm is the oracle with the bug: {req['reason']}")
    if req["mode"] == "generate":
        return generate(req)
    return score(req)


def main():
    mx.set_default_device(mx.cpu)
    answer_all(__doc__, "mlx-lm", answer, progress=lambda cases: tqdm(cases, desc="mlx-lm answering", unit="case"))


if __name__ == "__main__":
    sys.exit(main())
