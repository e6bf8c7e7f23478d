"""Checks that mlx-lm loads prompt cache files written by verity and continues exactly.

For every golden trace that starts from a prompt cache (golden/traces/**, `prompt_cache` set),
`verity cache-prompt` writes the cache of the same prefix; this script then
1. compares every tensor and metadata entry with the file mlx-lm wrote for the golden, and
2. loads verity's file with mlx_lm's load_prompt_cache and continues generation with the
   trace's parameters, which must reproduce the golden steps (tokens and logprob bits).

    cargo build --release && oracles/.venv/bin/python oracles/test_prompt_cache.py [VERITY_BIN]
Exit 0 when every case holds, 1 otherwise.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import load_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

ROOT = Path(__file__).resolve().parent.parent


def verity_cache(binary, trace, out):
    p = trace["params"]
    cmd = [binary, "--device", "cpu", "cache-prompt", "--model", str(ROOT / trace["model"]),
           "--tokens", ",".join(map(str, trace["prompt_cache"]["tokens"])), "--out", out,
           "--prefill-step-size", str(p["prefill_step_size"])]
    if p["max_kv_size"] is not None:
        cmd += ["--max-kv-size", str(p["max_kv_size"])]
    if p["kv_bits"] is not None:
        cmd += ["--kv-bits", str(p["kv_bits"]), "--kv-group-size", str(p["kv_group_size"]),
                "--quantized-kv-start", str(p["quantized_kv_start"])]
    subprocess.run(cmd, check=True, capture_output=True)


def same_file(mine, theirs):
    """Every tensor bit-identical and the same class/scalar metadata (user metadata aside)."""
    a, ma = mx.load(mine, return_metadata=True)
    b, mb = mx.load(theirs, return_metadata=True)
    if sorted(a) != sorted(b):
        return f"tensor keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not mx.array_equal(a[k], b[k]).item():
            return f"tensor {k} differs"
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("0.")}
    if strip(ma) != strip(mb):
        return "class or scalar metadata differs"
    return None


def continue_generation(trace, cache_file):
    p = trace["params"]
    model, tokenizer = load(str(ROOT / trace["model"]))
    sampler = make_sampler(**p["sampler"])
    procs = p["processors"]
    bias = {int(k): v for k, v in procs["logit_bias"].items()} if procs["logit_bias"] else None
    processors = make_logits_processors(
        bias, procs["repetition_penalty"], procs["repetition_context_size"], procs["presence_penalty"],
        procs["presence_context_size"], procs["frequency_penalty"], procs["frequency_context_size"])
    if p["seed"] is not None:
        mx.random.seed(p["seed"])
    steps = []
    for r in stream_generate(model, tokenizer, trace["prompt"]["tokens"], max_tokens=p["max_tokens"],
                             sampler=sampler, logits_processors=processors,
                             prompt_cache=load_prompt_cache(cache_file),
                             prefill_step_size=p["prefill_step_size"], kv_bits=p["kv_bits"],
                             kv_group_size=p["kv_group_size"], quantized_kv_start=p["quantized_kv_start"]):
        steps.append((int(r.token), float(r.logprobs[r.token].astype(mx.float32).item())))
    return steps


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/release/verity")
    mx.set_default_device(mx.cpu)
    traces = [json.loads(p.read_text()) for p in sorted((ROOT / "golden/traces").rglob("*.json"))]
    traces = [t for t in traces if t.get("prompt_cache")]
    if not traces:
        sys.exit("no prompt-cache traces under golden/traces")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for trace in traces:
            mine = str(Path(tmp) / "cache.safetensors")
            verity_cache(binary, trace, mine)
            problem = same_file(mine, str(ROOT / trace["prompt_cache"]["file"]))
            want = [(s["token"], s["logprob"]) for s in trace["steps"]]
            if problem is None and continue_generation(trace, mine) != want:
                problem = "mlx-lm's continuation from verity's file differs from the golden"
            print(f"{'FAIL' if problem else 'ok  '} {trace['id']}" + (f": {problem}" if problem else ""))
            if problem:
                failures.append(trace["id"])
    print(f"{len(traces) - len(failures)} of {len(traces)} verity-written prompt caches load in mlx-lm exactly")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
