"""Confirms every entry of golden/known-oracle-bugs.toml: each reproducer returns True while the
oracle still misbehaves. Exit 0 when all still do, 1 when one no longer does (retire the entry),
2 when a reproducer cannot run.

    oracles/.venv/bin/python oracles/known_bugs.py [ID...]
"""

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors
from reproducers import run

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "golden" / "models"
CODE = 'import os\n\n\ndef read_config(path):\n    """Return the parsed configuration'


def tokens(target, draft=None, prompt=CODE, max_tokens=48, **kwargs):
    model, tok = load(str(MODELS / target))
    if draft is not None:
        kwargs["draft_model"] = load(str(MODELS / draft))[0]
    return [r.token for r in stream_generate(model, tok, tok.encode(prompt), max_tokens=max_tokens, **kwargs)]


def rotating_cache_speculation():
    """gemma3 (window 16) greedy: speculative output differs from plain past the window."""
    return tokens("gemma3") != tokens("gemma3", "llama-draft", num_draft_tokens=3)


def hybrid_speculation_refused():
    """qwen3_next with a draft model raises instead of speculating."""
    try:
        tokens("qwen3_next", "llama-draft", num_draft_tokens=3)
    except ValueError as e:
        return "trimmable" in str(e)
    return False


def speculative_processors_hide_the_prompt():
    """Greedy with a repetition penalty: speculative output differs from plain."""
    procs = make_logits_processors(repetition_penalty=1.3)
    plain = tokens("qwen3-target", logits_processors=procs)
    spec = tokens("qwen3-target", "qwen3-draft", logits_processors=procs, num_draft_tokens=3)
    return plain != spec


def batch_rotating_cache_drops_keep():
    """qwen3 with max_kv_size 24, a batch of one row: BatchGenerator's tokens differ from
    stream_generate's with the same max_kv_size once the window fills."""
    model, tok = load(str(MODELS / "qwen3"))
    ids = tok.encode(CODE)
    alone = [r.token for r in stream_generate(model, tok, ids, max_tokens=16, max_kv_size=24)]
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids], max_kv_size=24)
    gen.insert([ids], [16])
    batched = []
    while responses := gen.next_generated():
        batched.extend(int(r.token) for r in responses)
    gen.close()
    return batched != alone


def vlm_batch_hybrid_rows():
    """mlx-vlm's BatchGenerator on the hybrid qwen3_5-trained, greedy, three prompts of
    different lengths: a left-padded row's tokens differ from the same prompt alone."""
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate import stream_generate as vlm_stream_generate
    from mlx_vlm.generate.ar import BatchGenerator as VlmBatchGenerator
    from mlx_vlm.generate.ar import _split_prompt_kwargs_per_row
    from mlx_vlm.utils import prepare_inputs

    model, processor = vlm_load(str(MODELS / "qwen3_5-trained"))
    prompts = ["def fibonacci(n):", "The capital of France is a city that", CODE]
    inputs = prepare_inputs(processor, prompts=prompts, add_special_tokens=True)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    embedded = model.get_input_embeddings(ids, None, mask=mask)
    kwargs = _split_prompt_kwargs_per_row(
        {k: v for k, v in embedded.to_dict().items() if v is not None}, len(prompts))
    gen = VlmBatchGenerator(model.language_model, processor, prefill_batch_size=3,
                            completion_batch_size=3, compute_logprobs=False)
    uids = gen.insert(ids, [24] * 3, prompt_kwargs=kwargs, attention_mask=mask)
    batched = {uid: [] for uid in uids}
    while gen.has_work:
        for r in gen.next()[1]:
            batched[r.uid].append(int(r.token))
    gen.close()
    for i, uid in enumerate(uids):
        prompt = [t for t, m in zip(ids[i].tolist(), mask[i].tolist()) if m]
        alone = [r.token for r in vlm_stream_generate(model, processor, "", input_ids=mx.array([prompt]),
                                                      max_tokens=24, temperature=0.0)][:-1]
        if batched[uid][:len(alone)] != alone:
            return True
    return False


class Server:
    """mlx_lm.server on a free 127.0.0.1 port, stopped on exit."""

    def __init__(self, *args):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cache = tempfile.mkdtemp()
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=self.cache)
        cmd = [sys.executable, "-m", "mlx_lm.server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return self
            except OSError:
                time.sleep(0.25)
        raise RuntimeError("mlx_lm.server did not come up")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=60))


def server_draft_with_prompt_cache():
    """Identical greedy chat requests with a draft model: once the prompt cache is reused the
    answer changes (it starts with a stray "<|im_start|>assistant")."""
    args = ["--model", str(MODELS / "qwen3-target"), "--draft-model", str(MODELS / "qwen3-draft"),
            "--num-draft-tokens", "3"]
    with Server(*args) as server:
        body = {"messages": [{"role": "user", "content": "What does the function os.path.join do?"}],
                "max_tokens": 40, "temperature": 0.0}
        texts = [server.post("/v1/chat/completions", body)["choices"][0]["message"]["content"] for _ in range(3)]
    return len(set(texts)) > 1


def server_top_logprobs_unsorted():
    """top_logprobs are not sorted by logprob, or the reported token is not the sampled one."""
    with Server("--model", str(MODELS / "qwen3-target")) as server:
        body = {"messages": [{"role": "user", "content": "What does the function os.path.join do?"}],
                "max_tokens": 24, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
        content = server.post("/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    for entry in content:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        if tops != sorted(tops, reverse=True) or entry["logprob"] != max(tops):
            return True
    return False


def server_xtc_threshold_above_half():
    """mlx_lm.server accepts an xtc_threshold up to 1, but its sampler refuses one above 0.5, so
    such a request gets no response at all: the connection closes without an answer."""
    with Server("--model", str(MODELS / "qwen3-target")) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0,
                "xtc_probability": 0.5, "xtc_threshold": 0.7}
        try:
            server.post("/v1/chat/completions", body)
        except urllib.error.HTTPError:
            return False  # a refusal is an answer
        except (http.client.RemoteDisconnected, ConnectionError):
            return True
    return False


def main():
    mx.set_default_device(mx.cpu)
    run(ROOT / "golden" / "known-oracle-bugs.toml", lambda bug: globals()[bug["reproducer"]])


if __name__ == "__main__":
    main()
