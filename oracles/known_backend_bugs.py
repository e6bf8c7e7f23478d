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


REPRODUCERS = {"cuda-qmm-k64": cuda_qmm_k64}


def main():
    run(ROOT / "golden" / "known-backend-bugs.toml", lambda bug: REPRODUCERS[bug["id"]])


if __name__ == "__main__":
    main()
