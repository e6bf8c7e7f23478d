"""Records the ops golden: every op the Rust `mlx` crate binds, run through Python MLX.

Writes golden/ops/ops.safetensors (inputs and outputs) and golden/ops/cases.json (one entry per
case: the op, its arguments, and the tensor names). The crate's test mlx/tests/ops_golden.rs runs
each case through the binding and demands the same bits, dtype and shape.

Inputs come from a fixed seed, so rerunning rewrites identical files.

    oracles/.venv/bin/python oracles/record_ops.py [OUT_DIR]
"""

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import precise_swiglu, swiglu
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    def __init__(self):
        self.tensors = {}
        self.cases = []
        self.key = mx.random.key(20261129)

    def rand(self, shape, dtype=mx.float32, scale=1.0):
        self.key, sub = mx.random.split(self.key)
        return (mx.random.normal(shape, key=sub) * scale).astype(dtype)

    def case(self, name, op, inputs, outputs, **args):
        if any(c["name"] == name for c in self.cases):
            raise ValueError(f"duplicate case name {name}")
        in_names = []
        for i, a in enumerate(inputs):
            in_names.append(f"{name}.in{i}")
            self.tensors[in_names[-1]] = a
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        out_names = []
        for i, a in enumerate(outputs):
            out_names.append(f"{name}.out{i}")
            self.tensors[out_names[-1]] = a
        self.cases.append(
            {"name": name, "op": op, "args": args, "inputs": in_names, "outputs": out_names}
        )

    def save(self, out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        mx.eval(list(self.tensors.values()))
        mx.save_safetensors(str(out_dir / "ops.safetensors"), self.tensors, metadata={"format": "mlx"})
        doc = {"format": "verity-ops/1", "mlx_version": mx.__version__, "cases": self.cases}
        (out_dir / "cases.json").write_text(json.dumps(doc, indent=1) + "\n")


def record(r):
    x = r.rand((4, 33))
    y = r.rand((4, 33))
    pos = mx.abs(x) + 0.1
    ints = mx.array([[3, -7, 0, 12], [5, 5, -1, 9]], dtype=mx.int32)
    bools = x > 0

    unary = {
        "negative": (mx.negative, x), "abs": (mx.abs, x), "exp": (mx.exp, x),
        "expm1": (mx.expm1, x), "log": (mx.log, pos), "log1p": (mx.log1p, pos),
        "sqrt": (mx.sqrt, pos), "rsqrt": (mx.rsqrt, pos), "square": (mx.square, x),
        "reciprocal": (mx.reciprocal, pos), "sigmoid": (mx.sigmoid, x), "tanh": (mx.tanh, x),
        "sin": (mx.sin, x), "cos": (mx.cos, x), "erf": (mx.erf, x), "floor": (mx.floor, x * 3),
        "ceil": (mx.ceil, x * 3), "round": (mx.round, x * 3), "sign": (mx.sign, x),
        "logical_not": (mx.logical_not, bools), "isnan": (mx.isnan, mx.log(x)),
        "stop_gradient": (mx.stop_gradient, x),
    }
    for name, (f, a) in unary.items():
        r.case(name, name, [a], f(a))
    r.case("exp_bf16", "exp", [x.astype(mx.bfloat16)], mx.exp(x.astype(mx.bfloat16)))

    binary = {
        "add": mx.add, "subtract": mx.subtract, "multiply": mx.multiply, "divide": mx.divide,
        "maximum": mx.maximum, "minimum": mx.minimum, "remainder": mx.remainder,
        "floor_divide": mx.floor_divide, "logaddexp": mx.logaddexp, "equal": mx.equal,
        "not_equal": mx.not_equal, "less": mx.less, "less_equal": mx.less_equal,
        "greater": mx.greater, "greater_equal": mx.greater_equal,
    }
    for name, f in binary.items():
        r.case(name, name, [x, y], f(x, y))
    r.case("power", "power", [pos, y], mx.power(pos, y))
    r.case("add_broadcast", "add", [x, y[0:1]], x + y[0:1])
    r.case("add_ints", "add", [ints, ints[::-1]], ints + ints[::-1])
    r.case("logical_and", "logical_and", [bools, y > 0], mx.logical_and(bools, y > 0))
    r.case("logical_or", "logical_or", [bools, y > 0], mx.logical_or(bools, y > 0))
    a, b = r.rand((3, 17, 64)), r.rand((64, 40))
    r.case("matmul", "matmul", [a, b], a @ b)
    q, k = r.rand((2, 4, 5, 32)), r.rand((2, 4, 32, 7))
    r.case("matmul_batched", "matmul", [q, k], q @ k)
    c = r.rand((17, 40))
    r.case("addmm", "addmm", [c, a[0], b], mx.addmm(c, a[0], b, alpha=0.5, beta=2.0), alpha=0.5, beta=2.0)

    for name in ["sum", "mean", "prod", "max", "min", "logsumexp"]:
        f = getattr(mx, name)
        r.case(f"{name}_all", name, [x], f(x), axes=[], keepdims=False)
        r.case(f"{name}_last", name, [x], f(x, axis=-1, keepdims=True), axes=[-1], keepdims=True)
    r.case("all", "all", [bools], mx.all(bools, axis=0), axes=[0], keepdims=False)
    r.case("any", "any", [bools], mx.any(bools, axis=1), axes=[1], keepdims=False)
    r.case("argmax", "argmax", [x], mx.argmax(x, axis=-1), axis=-1, keepdims=False)
    r.case("argmin", "argmin", [x], mx.argmin(x, axis=0, keepdims=True), axis=0, keepdims=True)
    ties = mx.array([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    r.case("argmax_ties_first", "argmax", [ties], mx.argmax(ties, axis=-1), axis=-1, keepdims=False)

    r.case("where", "where", [bools, x, y], mx.where(bools, x, y))
    lo, hi = mx.array(-0.5), mx.array(0.75)
    r.case("clip", "clip", [x, lo, hi], mx.clip(x, lo, hi))
    for dt in ["bfloat16", "float16", "int32", "uint32"]:
        r.case(f"astype_{dt}", "astype", [x * 10], (x * 10).astype(getattr(mx, dt)), dtype=dt)
    r.case("softmax", "softmax", [x], mx.softmax(x, axis=-1), axes=[-1], precise=False)
    xb = x.astype(mx.bfloat16)
    r.case("softmax_precise_bf16", "softmax", [xb], mx.softmax(xb, axis=-1, precise=True), axes=[-1], precise=True)
    for rev in (False, True):
        for inc in (False, True):
            r.case(f"cumsum_r{int(rev)}_i{int(inc)}", "cumsum", [x],
                   mx.cumsum(x, axis=-1, reverse=rev, inclusive=inc), axis=-1, reverse=rev, inclusive=inc)

    t = r.rand((2, 3, 4, 5))
    r.case("reshape", "reshape", [t], t.reshape(6, -1), shape=[6, -1])
    r.case("transpose", "transpose", [t], t.transpose(0, 2, 1, 3), axes=[0, 2, 1, 3])
    r.case("expand_dims", "expand_dims", [t], mx.expand_dims(t, [0, 3]), axes=[0, 3])
    r.case("squeeze", "squeeze", [t[:, :1]], mx.squeeze(t[:, :1], 1), axes=[1])
    r.case("broadcast_to", "broadcast_to", [t[:1]], mx.broadcast_to(t[:1], (3, 3, 4, 5)), shape=[3, 3, 4, 5])
    r.case("flatten", "flatten", [t], mx.flatten(t, 1, 2), start=1, end=2)
    r.case("moveaxis", "moveaxis", [t], mx.moveaxis(t, 2, 1), source=2, destination=1)
    r.case("slice", "slice", [t], t[:, 1:3, ::2, 1:], start=[0, 1, 0, 1], stop=[2, 3, 4, 5], strides=[1, 1, 2, 1])
    upd = r.rand((2, 2, 2, 4))
    r.case("slice_update", "slice_update", [t, upd], _slice_update(t, upd),
           start=[0, 1, 0, 1], stop=[2, 3, 4, 5], strides=[1, 1, 2, 1])
    r.case("concatenate", "concatenate", [t, t * 2], mx.concatenate([t, t * 2], axis=2), axis=2)
    r.case("stack", "stack", [x, y], mx.stack([x, y], axis=1), axis=1)
    r.case("split", "split_sections", [x], mx.split(x, [5, 20], axis=1), indices=[5, 20], axis=1)
    r.case("split_equal", "split", [x], mx.split(x, 2, axis=0), parts=2, axis=0)
    r.case("repeat", "repeat", [t], mx.repeat(t, 3, axis=1), repeats=3, axis=1)
    r.case("pad", "pad", [x, mx.array(-1.0)], mx.pad(x, [(1, 2), (0, 3)], constant_values=-1.0),
           axes=[0, 1], low=[1, 0], high=[2, 3])
    idx = mx.array([3, 0, 3, 1], dtype=mx.uint32)
    r.case("take", "take", [x, idx], x[idx], axis=0)
    r.case("take_axis1", "take", [x, idx], mx.take(x, idx, axis=1), axis=1)
    idx2 = mx.argsort(x, axis=-1)[:, :5]
    r.case("take_along_axis", "take_along_axis", [x, idx2], mx.take_along_axis(x, idx2, axis=-1), axis=-1)
    r.case("put_along_axis", "put_along_axis", [x, idx2, y[:, :5]],
           mx.put_along_axis(x, idx2, y[:, :5], axis=-1), axis=-1)
    tok = mx.array([5, 1, 5, 30], dtype=mx.int32)
    logits = r.rand((1, 33))
    upd1 = r.rand((1, 4))
    # Python's `a[:, idx] = v` and `a.at[:, idx].subtract(p)` (duplicates accumulate), as the
    # logits processors use them; the binding gets the (n, 1, 1) updates MLX's scatter takes.
    tok_once = mx.array([5, 1, 30], dtype=mx.int32)
    r.case("scatter_setitem", "scatter", [logits, tok_once, upd1[:, :3].T.reshape(3, 1, 1)], _set_columns(logits, tok_once, upd1[:, :3]), axes=[1])
    r.case("scatter_add_at", "scatter_add", [logits, tok, mx.full((4, 1, 1), -0.7)],
           logits.at[:, tok].subtract(0.7), axes=[1])
    r.case("sort", "sort", [x], mx.sort(x, axis=-1), axis=-1)
    r.case("argsort", "argsort", [x], mx.argsort(x, axis=-1), axis=-1)
    r.case("argpartition", "argpartition", [x], mx.argpartition(x, kth=5, axis=-1), kth=5, axis=-1)
    r.case("topk", "topk", [x], mx.topk(x, 4, axis=-1), k=4, axis=-1)
    sq = r.rand((5, 5))
    r.case("tril", "tril", [sq], mx.tril(sq, k=-1), k=-1)

    seq, w = r.rand((1, 7, 24)), r.rand((24, 4, 1))
    r.case("conv1d_depthwise", "conv1d", [seq, w], mx.conv1d(seq, w, groups=24),
           stride=1, padding=0, dilation=1, groups=24)
    w2 = r.rand((6, 3, 24))
    r.case("conv1d", "conv1d", [seq, w2], mx.conv1d(seq, w2, padding=1), stride=1, padding=1, dilation=1, groups=1)
    wq = r.rand((64, 128), scale=0.1)
    for bits, gs in [(4, 64), (8, 32), (4, 32)]:
        qw, sc, bi = mx.quantize(wq, group_size=gs, bits=bits)
        r.case(f"quantize_b{bits}_g{gs}", "quantize", [wq], [qw, sc, bi], group_size=gs, bits=bits, mode="affine")
        r.case(f"dequantize_b{bits}_g{gs}", "dequantize", [qw, sc, bi],
               mx.dequantize(qw, sc, bi, group_size=gs, bits=bits), group_size=gs, bits=bits, mode="affine")
        xs = r.rand((1, 3, 128))
        r.case(f"quantized_matmul_b{bits}_g{gs}", "quantized_matmul", [xs, qw, sc, bi],
               mx.quantized_matmul(xs, qw, sc, bi, transpose=True, group_size=gs, bits=bits),
               transpose=True, group_size=gs, bits=bits, mode="affine")

    h = r.rand((1, 5, 64))
    wn = r.rand((64,)) + 1
    r.case("rms_norm", "rms_norm", [h, wn], mx.fast.rms_norm(h, wn, 1e-6), eps=1e-6)
    r.case("rms_norm_noweight", "rms_norm", [h], mx.fast.rms_norm(h, None, 1e-5), eps=1e-5)
    bn = r.rand((64,))
    r.case("layer_norm", "layer_norm", [h, wn, bn], mx.fast.layer_norm(h, wn, bn, 1e-5), eps=1e-5)
    hq = r.rand((1, 4, 6, 32))
    for trad in (False, True):
        r.case(f"rope_trad{int(trad)}", "rope", [hq],
               mx.fast.rope(hq, 32, traditional=trad, base=10000.0, scale=1.0, offset=13),
               dims=32, traditional=trad, base=10000.0, scale=1.0, offset=13)
    r.case("rope_partial", "rope", [hq], mx.fast.rope(hq, 8, traditional=False, base=1e6, scale=0.5, offset=300),
           dims=8, traditional=False, base=1e6, scale=0.5, offset=300)
    freqs = mx.exp(r.rand((16,)))
    r.case("rope_freqs", "rope", [hq, freqs], mx.fast.rope(hq, 32, traditional=False, base=None, scale=1.0, offset=2, freqs=freqs),
           dims=32, traditional=False, scale=1.0, offset=2)
    kq, vq = r.rand((1, 2, 9, 32)), r.rand((1, 2, 9, 32))
    qq = r.rand((1, 4, 9, 32))
    scale = 32 ** -0.5
    for mode in ["none", "causal"]:
        mask = None if mode == "none" else "causal"
        r.case(f"sdpa_{mode}", "sdpa", [qq, kq, vq],
               mx.fast.scaled_dot_product_attention(qq, kq, vq, scale=scale, mask=mask), scale=scale, mask=mode)
    bmask = mx.arange(9)[None, :] <= mx.arange(9)[:, None] + 2
    r.case("sdpa_array", "sdpa", [qq, kq, vq, bmask],
           mx.fast.scaled_dot_product_attention(qq, kq, vq, scale=scale, mask=bmask), scale=scale, mask="array")
    r.case("sdpa_causal_decode", "sdpa", [qq[:, :, -3:], kq, vq],
           mx.fast.scaled_dot_product_attention(qq[:, :, -3:], kq, vq, scale=scale, mask="causal"),
           scale=scale, mask="causal")

    key = mx.random.key(42)
    r.case("random_key", "random_key", [], key, seed=42)
    r.case("random_key_big", "random_key", [], mx.random.key(2**40 + 7), seed=2**40 + 7)
    r.case("random_split", "random_split", [key], mx.random.split(key, 3), num=3)
    r.case("random_uniform", "random_uniform", [key], mx.random.uniform(shape=(3, 5), key=key), shape=[3, 5], dtype="float32")
    r.case("random_normal", "random_normal", [key], mx.random.normal(shape=(3, 5), key=key), shape=[3, 5], dtype="float32")
    r.case("random_uniform_scalar", "random_uniform", [key], mx.random.uniform(0, 1, key=key), shape=[], dtype="float32")
    r.case("random_gumbel", "random_gumbel", [key], mx.random.gumbel(shape=(3, 5), key=key), shape=[3, 5], dtype="float32")
    lg = r.rand((1, 33), scale=2.0)
    r.case("categorical_row", "random_categorical", [lg, key], mx.random.categorical(lg, key=key), axis=-1)
    lg3 = r.rand((3, 33), scale=2.0)
    r.case("categorical_rows", "random_categorical", [lg3, key], mx.random.categorical(lg3, key=key), axis=-1)
    # Python's global key sequence: seed, then each keyless draw splits the state once.
    mx.random.seed(7)
    draws = [mx.random.categorical(lg) for _ in range(4)] + [mx.random.uniform(shape=(2,))]
    r.case("key_sequence", "key_sequence", [lg], draws, seed=7)

    r.case("silu", "compiled_silu", [x], nn.silu(x))
    r.case("swiglu", "compiled_swiglu", [x, y], swiglu(x, y))
    r.case("gelu_approx", "compiled_gelu_approx", [x * 3], nn.gelu_approx(x * 3))
    r.case("softplus", "compiled_softplus", [x * 3], nn.softplus(x * 3))
    r.case("nn_sigmoid", "compiled_sigmoid", [x], nn.sigmoid(x))
    r.case("precise_swiglu", "compiled_precise_swiglu", [xb, x, y], precise_swiglu(xb, x, y))
    a_log, a_in, dt = mx.log(mx.abs(r.rand((4,))) * 8 + 0.5), r.rand((1, 3, 4)), r.rand((4,))
    r.case("compute_g", "compiled_compute_g", [a_log, a_in, dt], compute_g(a_log, a_in, dt))
    gq, gk = r.rand((1, 4, 32), scale=0.2), r.rand((1, 4, 32), scale=0.2)
    gv, gg, gb, gs = r.rand((1, 4, 16)), mx.sigmoid(r.rand((1, 4))), mx.sigmoid(r.rand((1, 4))), r.rand((1, 4, 16, 32))
    r.case("gated_delta_step", "compiled_gated_delta_step", [gq, gk, gv, gg, gb, gs],
           list(_gated_delta_step_ops(gq, gk, gv, gg, gb, gs)))
    r.case("swiglu_bf16", "compiled_swiglu", [xb, y.astype(mx.bfloat16)], swiglu(xb, y.astype(mx.bfloat16)))


def _set_columns(a, idx, v):
    out = mx.array(a)
    out[:, idx] = v
    return out


def _slice_update(t, upd):
    out = mx.array(t)
    out[:, 1:3, ::2, 1:] = upd
    return out


def main():
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "golden" / "ops"
    mx.set_default_device(mx.cpu)
    r = Recorder()
    record(r)
    r.save(out_dir)
    print(f"ops golden: {len(r.cases)} cases -> {out_dir}")


if __name__ == "__main__":
    main()
