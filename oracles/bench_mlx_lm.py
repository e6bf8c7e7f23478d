"""mlx-lm's side of `verity bench speed`: loads a model (and a draft) once, then times runs that
verity asks for, one JSON line per request on stdin and one per answer on stdout, so that both
engines are measured in the same run, interleaved, on the same prompts.

    oracles/.venv/bin/python oracles/bench_mlx_lm.py --model DIR [--draft-model DIR] [--device gpu]

Requests: {"prompt": [ids], "max_tokens": N, "prefill_step_size": S, "num_draft_tokens": K or
null}. A run is mlx-lm's own decode loop (generate_step, or speculative_generate_step with the
draft), greedy, without EOS stopping, so both engines produce the same number of tokens. The
answer: {"ttft_s", "decode_s", "generated", "prefill_peak_bytes" (until the first token),
"peak_bytes", "split"}; an error is
{"error": message}. "split" (plain runs) tells where the host's decode time went, as verity's
Generation measures it: building the next step's graph (generate_step's `_step`), handing it to
MLX (`mx.async_eval`, timed by wrapping it), and waiting for the token (`y.item()`), summed over
the steps after the first token.
"""

import common  # noqa: F401  (offline guard first)

import argparse
import json
import sys
import time

import mlx.core as mx


class AsyncEvalClock:
    """Wraps mx.async_eval (generate_step looks it up on the module at each call) to note when
    each call starts and ends."""

    def __init__(self):
        self.calls = 0
        self.start = self.end = 0.0
        self.inner = mx.async_eval
        mx.async_eval = self

    def __call__(self, *arrays):
        self.start = time.perf_counter()
        self.inner(*arrays)
        self.end = time.perf_counter()
        self.calls += 1


ASYNC_EVAL = AsyncEvalClock()


def run(model, draft, request):
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    prompt = mx.array(request["prompt"], dtype=mx.uint32)
    k = request.get("num_draft_tokens")
    common_args = dict(
        max_tokens=request["max_tokens"],
        sampler=make_sampler(0.0),
        prefill_step_size=request["prefill_step_size"],
    )
    if k is None:
        steps = generate_step(prompt, model, **common_args)
    else:
        steps = speculative_generate_step(prompt, model, draft, num_draft_tokens=k, **common_args)
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = last = None
    prefill_peak = 0
    generated = 0
    split = {"build_s": 0.0, "enqueue_s": 0.0, "wait_s": 0.0, "steps": 0}
    seen = 0
    for step in steps:
        # generate_step built and enqueued the next step, then waited in y.item(), before
        # yielding this token.
        token = step[0]
        int(token)  # the token id on the host, as a caller would use it
        now = time.perf_counter()
        if first is None:
            prefill_peak = mx.get_peak_memory()
        else:
            split["steps"] += 1
            if ASYNC_EVAL.calls > seen:
                split["build_s"] += ASYNC_EVAL.start - last
                split["enqueue_s"] += ASYNC_EVAL.end - ASYNC_EVAL.start
                split["wait_s"] += now - ASYNC_EVAL.end
            else:
                split["wait_s"] += now - last
        seen = ASYNC_EVAL.calls
        last = now
        first = first or last
        generated += 1
    return {
        "ttft_s": first - start,
        "decode_s": last - first,
        "generated": generated,
        "prefill_peak_bytes": prefill_peak,
        "peak_bytes": mx.get_peak_memory(),
        "split": split if k is None else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = ap.parse_args()
    # Before mlx_lm.generate is imported: it creates its generation stream on the default
    # device at import time (and common.py selects the CPU).
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    from mlx_lm import load

    start = time.perf_counter()
    model, _ = load(args.model)
    draft = load(args.draft_model)[0] if args.draft_model else None
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        try:
            answer = run(model, draft, json.loads(line))
        except Exception as e:  # noqa: BLE001  (the error goes back to the caller)
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
