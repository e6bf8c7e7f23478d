"""Answers a `verity judge export` requests file with Hugging Face transformers on the CPU
(protocol verity-judge/1, docs/judge.md): a second framework, judged with check's verdicts.

    target/hf-venv/bin/python oracles/judge_transformers.py requests.jsonl responses.jsonl

(the venv: oracles/requirements-transformers.txt). Each model folder is loaded with
AutoModelForCausalLM.from_pretrained in float32, offline, and then given the folder's own
weights again, mapped from mlx-lm's layout to transformers' (qwen3_next's conv1d axes and its
(1 + w) RMSNorm weights; qwen3_5 loads as it is, text only), every parameter accounted for. A score request is one forward over
prompt + the oracle's tokens, log_softmax in float32; a greedy generate request decodes step by
step, one full forward per step. A prompt cache's prefix tokens are processed first.

Answered unsupported: sampling (mlx seeds), drafts, batches, logits processors, quantized KV,
a rotating KV window that the case fills, mlx's 4-bit affine weights, and any folder or case
transformers raises on (the error is the answer).
"""

import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402

from judge_protocol import Unsupported, answer_all  # noqa: E402

logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
# RMSNorm weights mlx-lm stores as the factor itself; transformers' qwen3_next computes x * (1 + w).
PLUS_ONE_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                  ".q_norm.weight", ".k_norm.weight")


def hf_weights(folder, config, names):
    """The folder's safetensors mapped to transformers' parameter names and layout."""
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
    hybrid = config.get("model_type") == "qwen3_next"  # qwen3_5's folders keep HF's norms
    out = {}
    for k, v in w.items():
        if "mtp." in k or k.startswith("model.visual."):  # text only, as mlx-lm loads it
            continue
        if k not in names and k.replace("model.language_model.", "model.") in names:
            k = k.replace("model.language_model.", "model.")
        if hybrid and "conv1d.weight" in k and v.shape[-1] == 1:
            v = np.moveaxis(v, 2, 1)  # mlx (C, K, 1) -> torch (C, 1, K)
        if hybrid and v.ndim == 1 and any(k.endswith(s) for s in PLUS_ONE_NORMS):
            v = v - 1.0
        out[k] = torch.from_numpy(np.ascontiguousarray(v.astype(np.float32)))
    return out


MODELS = {}


def model(path):
    """transformers' model of a repository-relative folder, loaded once (or why it cannot be)."""
    if path not in MODELS:
        try:
            MODELS[path] = load(ROOT / path)
        except Unsupported as e:
            MODELS[path] = e
        except Exception as e:  # noqa: BLE001 - the folder's answer for every case on it
            MODELS[path] = Unsupported(f"transformers cannot load {path}: {type(e).__name__}: {e}")
    if isinstance(MODELS[path], Unsupported):
        raise MODELS[path]
    return MODELS[path]


def load(folder):
    config = json.loads((folder / "config.json").read_text())
    if "quantization" in config:
        q = config["quantization"]
        raise Unsupported(f"mlx-lm {q.get('bits')}-bit {q.get('mode', 'affine')} quantized weights "
                          "(no transformers format)")
    m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                             attn_implementation="eager", ignore_mismatched_sizes=True)
    state = m.state_dict()
    w = hf_weights(folder, config, set(state))
    unexpected = sorted(set(w) - set(state))
    bad = [k for k in w if k in state and tuple(w[k].shape) != tuple(state[k].shape)]
    missing = [k for k in state if k not in w and not (k == "lm_head.weight" and
                                                       config.get("tie_word_embeddings", True))]
    if unexpected or bad or missing:
        raise Unsupported(f"{type(m).__name__} does not match the weights: unexpected "
                          f"{unexpected[:3]}, shape {bad[:3]}, missing {missing[:3]}")
    m.load_state_dict(w, strict=False)  # every weight again, in transformers' layout
    m.tie_weights()
    return m.eval()


@torch.no_grad()
def logprobs(m, ids):
    """float32 log_softmax of the next-token logits at every position of `ids`."""
    logits = m(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def step(token, lp, k):
    order = np.lexsort((np.arange(lp.size), -lp))[:k]
    return {"token": int(token), "logprob": float(lp[token]), "top": [[int(i), float(lp[i])] for i in order]}


def check_runnable(req, total):
    p = req["params"]
    if req["batch"] is not None:
        raise Unsupported("a batch row: transformers decodes the row alone, not mlx-lm's batch")
    if any(v is not None for k, v in p["processors"].items() if not k.endswith("context_size")):
        raise Unsupported("logits processors (bias and penalties) are not implemented here")
    if p["kv_bits"] is not None:
        raise Unsupported(f"mlx-lm's {p['kv_bits']}-bit quantized KV cache")
    if p["max_kv_size"] is not None and total > p["max_kv_size"]:
        raise Unsupported(f"mlx-lm's rotating KV window of {p['max_kv_size']}")
    if p.get("keys", "sequence") != "sequence":
        raise Unsupported("mlx-vlm's positioned keys")


def prefix(req):
    return req["prompt_cache"]["tokens"] if req["prompt_cache"] else []


def generate(req):
    if req["draft"] is not None:
        raise Unsupported(f"a {req['draft']['kind']} draft: mlx-lm's speculative rounds")
    if req["params"]["sampler"]["temp"] != 0.0:
        raise Unsupported("sampling: mlx's random draws (seeded mx.random) cannot be reproduced")
    ids, n = prefix(req) + req["prompt"], req["params"]["max_tokens"]
    check_runnable(req, len(ids) + n)
    m = model(req["model"])
    steps, finish, cache = [], "length", None
    with torch.no_grad():
        for _ in range(n):
            out = m(torch.tensor([ids if cache is None else ids[-1:]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1).numpy()
            token = int(np.lexsort((np.arange(lp.size), -lp))[0])
            steps.append(step(token, lp, req["top_k"]))
            ids.append(token)
            if token in req["eos_token_ids"]:
                finish = "stop"
                break
    return {"steps": steps, "finish_reason": finish}


def score(req):
    tokens = req["tokens"]
    ids = prefix(req) + req["prompt"] + tokens
    check_runnable(req, len(ids))
    lp = logprobs(model(req["model"]), ids)[len(ids) - len(tokens) - 1:-1]
    answer = {"scored": [{k: v for k, v in step(t, lp[i], req["top_k"]).items() if k != "token"}
                         for i, t in enumerate(tokens)]}
    if req.get("draft_tokens"):
        # The draft's greedy choice at every position, over the prompt (without a prompt cache's
        # prefix) and the oracle's tokens, as the mlx-lm adapter gives it.
        d = logprobs(model(req["draft"]["model"]), req["prompt"] + tokens)[len(req["prompt"]) - 1:-1]
        answer["draft_tokens"] = [int(np.lexsort((np.arange(r.size), -r))[0]) for r in d]
    return answer


def answer(req):
    if req["mode"] == "tier-c":
        raise Unsupported(f"a tier C case needs mlx-lm's speculative rounds: {req['reason']}")
    if req["mode"] == "generate":
        return generate(req)
    return score(req)


def main():
    torch.manual_seed(0)
    answer_all(__doc__, "transformers", answer)


if __name__ == "__main__":
    sys.exit(main())
