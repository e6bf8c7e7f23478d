"""Confirms the entries of golden/known-backend-bugs.toml on a machine with that backend: each
reproducer returns True while the pinned MLX still misbehaves there. Exit 0 when all named
bugs still show, 1 when one no longer does (retire the entry), 2 when a reproducer cannot run
(for example, no such backend on this machine). Pure MLX, no model files.

    python oracles/known_backend_bugs.py [ID...]
"""

from pathlib import Path

import mlx.core as mx
from reproducers import run

ROOT = Path(__file__).resolve().parent.parent


def qmm_error(rows, k, n=96, bits=4, group_size=64, dtype=mx.float32):
    """Largest |quantized_matmul - dequantize-then-matmul| on the GPU, relative to the largest
    output, for x (rows, k) against a (n, k) weight quantized with `bits` and `group_size`."""
    mx.random.seed(0)
    w = mx.random.normal((n, k)).astype(dtype)
    x = mx.random.normal((rows, k)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    exact = x @ mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits).T
    fast = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return (mx.abs(fast - exact).max() / mx.abs(exact).max()).item()


def cuda_qmm_k64():
    """4-bit, group 64: K = 64 with 7 rows is wrong (errors as large as the outputs) while one
    row is right; the relative error must stay tiny for the bug to count as fixed."""
    if not mx.cuda.is_available():
        raise RuntimeError("no CUDA backend in this MLX (install the mlx-cuda-13 wheel)")
    mx.set_default_device(mx.gpu)
    one_row, seven_rows = qmm_error(1, 64), qmm_error(7, 64)
    print(f"  K=64: relative error {one_row:.2e} with 1 row, {seven_rows:.2e} with 7 rows")
    return seven_rows > 1e-3


def greedy_decodes(model, prompt, steps):
    """The logits of `steps` greedy decode steps after prefilling `prompt`, through mlx-lm's
    KV caches (their 256-position buffers), as mlx-lm's generate_step runs them."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    out = []
    for _ in range(steps):
        token = mx.argmax(logits[0, -1]).reshape(1, 1)
        logits = model(token, cache=cache)
        mx.eval(logits)
        out.append(logits)
    return out


def cuda_half_decode_nondeterministic():
    """bfloat16, Qwen3-0.6B's layer shapes with random weights: greedy decoding after a prompt
    of 270 tokens (every step reads at least 256 keys, cuDNN's decode kernel) repeated in one
    process; the bug counts as fixed once every repetition gives the first one's bits. On an
    H100 (2026-12-05) each repetition left them within 0-16 steps, after 120 tokens none did."""
    if not mx.cuda.is_available():
        raise RuntimeError("no CUDA backend in this MLX (install the mlx-cuda-13 wheel)")
    from mlx_lm.models import qwen3

    mx.set_default_device(mx.gpu)
    mx.random.seed(0)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                           intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, rms_norm_eps=1e-6, vocab_size=4096,
                           max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True)
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, args.vocab_size, (270,))
    first = greedy_decodes(model, prompt, 20)
    equal = [all(mx.array_equal(a, b).item() for a, b in zip(first, greedy_decodes(model, prompt, 20)))
             for _ in range(4)]
    print(f"  4 repetitions of 20 steps after 270 tokens: {equal.count(True)} equal the first")
    return not all(equal)


REPRODUCERS = {
    "cuda-qmm-k64": cuda_qmm_k64,
    "cuda-half-decode-nondeterministic": cuda_half_decode_nondeterministic,
}


def main():
    run(ROOT / "golden" / "known-backend-bugs.toml", lambda bug: REPRODUCERS[bug["id"]])


if __name__ == "__main__":
    main()
