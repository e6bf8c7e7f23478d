"""Which MLX ops give a row of a multi-row call the bits of that row computed alone, on this
machine's default device: dense and quantized products (as one packed call, as the batched
one-row form verity's lone-row kernels use, src/model/lone_rows.rs), the small float32 products
of the mixture-of-experts fixtures (a row alone from a fresh buffer and from a shifted slice,
gather_mm), attention (a causal block of queries against one query at a time), RoPE, RMS norm,
softmax, logsumexp, argmax and gathers; with the time of each form. Random data, no model; docs/gpu-rows.md holds an H200's answer.

    python oracles/row_kernels.py        # on a CUDA or Metal machine (the CPU answers all-equal)
"""
import time
import mlx.core as mx

mx.random.seed(0)


def say(*a):
    print(" ".join(str(x) for x in a), flush=True)


def bits_equal(a, b):
    a = a.astype(mx.float32)
    b = b.astype(mx.float32)
    eq = mx.all(a == b).item()
    diff = mx.max(mx.abs(a - b)).item()
    return eq, diff


def rowsame(name, ref_rows, got):
    """ref_rows: list of (1, N) per row; got: (T, N)."""
    eqs = []
    md = 0.0
    for i, r in enumerate(ref_rows):
        e, d = bits_equal(r.reshape(-1), got[i].reshape(-1))
        eqs.append(e)
        md = max(md, d)
    say(f"{name}: rows equal {sum(eqs)}/{len(eqs)} maxdiff {md:.3g}")


def timeit(f, n=50):
    for _ in range(5):
        mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def lone_row_dense(x2, w):
    t, k = x2.shape
    a = x2.reshape(t, k, 1).swapaxes(1, 2)
    b = mx.broadcast_to(w.T, (t, k, w.shape[0]))
    return (a @ b).reshape(t, -1)


def lone_row_quant(x2, wq, s, b, gs, bits, chunk=7):
    t, k = x2.shape
    outs = []
    for st in range(0, t, chunk):
        xs = x2[st:st + chunk]
        n = xs.shape[0]
        y = mx.gather_qmm(xs.reshape(n, 1, k), wq[None], s[None], b[None],
                          rhs_indices=mx.zeros((n,), mx.uint32), transpose=True,
                          group_size=gs, bits=bits)
        outs.append(y.reshape(n, -1))
    return mx.concatenate(outs, 0)


say("device", mx.default_device(), mx.__version__)
for dt in (mx.bfloat16, mx.float32):
    for (k, n) in ((1024, 3072), (3072, 1024), (1024, 2048), (1024, 151936)):
        w = (mx.random.normal((n, k)) * 0.02).astype(dt)
        for t in (2, 4, 8, 33):
            x = mx.random.normal((t, k)).astype(dt)
            ref = [x[i:i + 1][None] @ w.T for i in range(t)]
            mx.eval(ref)
            rowsame(f"dense {dt} K{k} N{n} T{t} packed", ref, (x[None] @ w.T)[0])
            rowsame(f"dense {dt} K{k} N{n} T{t} lone-row", ref, lone_row_dense(x, w))
        if dt == mx.bfloat16:
            for t in (4, 8, 32):
                x = mx.random.normal((t, k)).astype(dt)
                tp = timeit(lambda: x[None] @ w.T)
                tq = timeit(lambda: lone_row_dense(x, w))
                t1 = timeit(lambda: x[:1][None] @ w.T)
                say(f"time dense K{k} N{n} T{t}: packed {tp:.1f}us lone-row {tq:.1f}us one-row {t1:.1f}us")

for bits, gs in ((4, 64), (8, 64), (4, 32)):
    for (k, n) in ((1024, 3072), (3072, 1024), (1024, 151936)):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        qm = lambda xx: mx.quantized_matmul(xx, wq, s, b, transpose=True, group_size=gs, bits=bits)
        for t in (2, 4, 8, 33):
            x = mx.random.normal((t, k)).astype(mx.bfloat16)
            ref = [qm(x[i:i + 1][None]) for i in range(t)]
            mx.eval(ref)
            rowsame(f"quant{bits}/{gs} K{k} N{n} T{t} packed", ref, qm(x[None])[0])
            rowsame(f"quant{bits}/{gs} K{k} N{n} T{t} batchedB", ref, qm(x.reshape(t, 1, k)).reshape(t, -1))
            try:
                rowsame(f"quant{bits}/{gs} K{k} N{n} T{t} lone-row", ref, lone_row_quant(x, wq, s, b, gs, bits))
            except Exception as e:
                say(f"quant{bits}/{gs} K{k} N{n} T{t} lone-row FAILED {e}")
        if bits == 4 and gs == 64:
            for t in (4, 8, 32):
                x = mx.random.normal((t, k)).astype(mx.bfloat16)
                tp = timeit(lambda: qm(x[None]))
                tq = timeit(lambda: lone_row_quant(x, wq, s, b, gs, bits))
                t1 = timeit(lambda: qm(x[:1][None]))
                say(f"time quant K{k} N{n} T{t}: packed {tp:.1f}us lone-row {tq:.1f}us one-row {t1:.1f}us")

# The small float32 products of the mixture-of-experts fixtures (hidden size 64: the router,
# qwen3_5_moe's one-output shared-expert gate, the experts through gather_mm). MLX's gemv picks
# how many elements a lane sums at a time from K and from the alignment of the base pointers,
# so each row alone is taken both from a fresh buffer and from a slice one element off.
for (k, n) in ((64, 1), (64, 4), (64, 64), (128, 1)):
    w = mx.random.normal((n, k)) * 0.1
    for t in (2, 5):
        x = mx.random.normal((t, k))
        fresh = [mx.array(x[i:i + 1])[None] @ w.T for i in range(t)]
        flat = mx.concatenate([mx.zeros((1,)), x.reshape(-1)])
        shifted = [flat[1 + i * k:1 + (i + 1) * k].reshape(1, 1, k) @ w.T for i in range(t)]
        mx.eval(fresh, shifted)
        rowsame(f"small f32 K{k} N{n} T{t} shifted alone vs fresh alone",
                [r.reshape(1, -1) for r in fresh], mx.concatenate(shifted, 0).reshape(t, -1))
        rowsame(f"small f32 K{k} N{n} T{t} lone-row", fresh, lone_row_dense(x, w))
        rowsame(f"small f32 K{k} N{n} T{t} packed", fresh, (x[None] @ w.T)[0])
        rowsame(f"small f32 K{k} N{n} T{t} row slices", fresh,
                mx.concatenate([x[i:i + 1][None] @ w.T for i in range(t)], 0).reshape(t, -1))
experts, top, k, n = 4, 2, 64, 64
we = mx.random.normal((experts, n, k)) * 0.1
for t in (2, 5):
    x = mx.random.normal((t, k))
    idx = mx.array([[(i + j) % experts for j in range(top)] for i in range(t)], mx.uint32)
    one = lambda xs, ix: mx.gather_mm(xs.reshape(-1, 1, 1, k), we.swapaxes(-1, -2), rhs_indices=ix)
    ref = [one(mx.array(x[i:i + 1]), idx[i:i + 1]) for i in range(t)]
    mx.eval(ref)
    rowsame(f"gather_mm f32 K{k} N{n} top{top} T{t}", [r.reshape(1, -1) for r in ref],
            one(x, idx).reshape(t, -1))

# attention: the step's shapes vs a causal block of T queries
for dt in (mx.bfloat16, mx.float32):
    for off in (40, 300, 700):
        H, KVH, D, T = 16, 8, 128, 4
        cap = ((off + T + 255) // 256) * 256
        kb = mx.random.normal((1, KVH, cap, D)).astype(dt)
        vb = mx.random.normal((1, KVH, cap, D)).astype(dt)
        mx.eval(kb, vb)
        q = mx.random.normal((1, H, T, D)).astype(dt)
        sc = D ** -0.5
        ref = [mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], kb[:, :, :off + i + 1],
                                                    vb[:, :, :off + i + 1], scale=sc)
               for i in range(T)]
        mx.eval(ref)
        blk = mx.fast.scaled_dot_product_attention(q, kb[:, :, :off + T], vb[:, :, :off + T],
                                                   scale=sc, mask="causal")
        rowsame(f"sdpa {dt} off{off} causal block", [r.transpose(2, 0, 1, 3).reshape(1, -1) for r in ref],
                blk.transpose(2, 0, 1, 3).reshape(T, -1))
        # queries as the batch axis, each masked to its own extent
        qb = q.transpose(2, 1, 0, 3)  # (T, H, 1, D)
        kk = mx.broadcast_to(kb[:, :, :off + T], (T, KVH, off + T, D))
        vv = mx.broadcast_to(vb[:, :, :off + T], (T, KVH, off + T, D))
        m = (mx.arange(off + T)[None, :] <= (off + mx.arange(T))[:, None]).reshape(T, 1, 1, off + T)
        try:
            bm = mx.fast.scaled_dot_product_attention(qb, kk, vv, scale=sc, mask=m)
            rowsame(f"sdpa {dt} off{off} batched masked", [r.transpose(2, 0, 1, 3).reshape(1, -1) for r in ref],
                    bm.reshape(T, -1))
        except Exception as e:
            say(f"sdpa batched masked FAILED {e}")
        if dt == mx.bfloat16:
            tb = timeit(lambda: mx.fast.scaled_dot_product_attention(q, kb[:, :, :off + T], vb[:, :, :off + T], scale=sc, mask="causal"))
            tr = timeit(lambda: [mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], kb[:, :, :off + i + 1], vb[:, :, :off + i + 1], scale=sc) for i in range(T)])
            say(f"time sdpa off{off} T{T}: block {tb:.1f}us per-row {tr:.1f}us")

# rope, rms_norm, softmax, logsumexp
for dt in (mx.bfloat16, mx.float32):
    x = mx.random.normal((1, 16, 5, 128)).astype(dt)
    r = [mx.fast.rope(x[:, :, i:i + 1], 128, traditional=False, base=1e6, scale=1.0, offset=77 + i) for i in range(5)]
    g = mx.fast.rope(x, 128, traditional=False, base=1e6, scale=1.0, offset=77)
    rowsame(f"rope {dt} offset block", [a.reshape(1, -1) for a in r], g.transpose(2, 0, 1, 3).reshape(5, -1))
    xb = x.transpose(2, 1, 0, 3)
    offs = mx.array([77, 3, 500, 1024, 9], mx.int32)
    r2 = [mx.fast.rope(xb[i:i + 1], 128, traditional=False, base=1e6, scale=1.0, offset=int(offs[i].item())) for i in range(5)]
    g2 = mx.fast.rope(xb, 128, traditional=False, base=1e6, scale=1.0, offset=offs)
    rowsame(f"rope {dt} array offsets", [a.reshape(1, -1) for a in r2], g2.reshape(5, -1))
    h = mx.random.normal((1, 9, 1024)).astype(dt)
    wn = mx.random.normal((1024,)).astype(dt)
    rowsame(f"rms_norm {dt}", [mx.fast.rms_norm(h[:, i:i + 1], wn, 1e-6).reshape(1, -1) for i in range(9)],
            mx.fast.rms_norm(h, wn, 1e-6)[0])
    lg = mx.random.normal((1, 9, 151936)).astype(dt)
    rowsame(f"logsumexp {dt}", [mx.logsumexp(lg[:, i:i + 1], axis=-1, keepdims=True).reshape(1, -1) for i in range(9)],
            mx.logsumexp(lg, axis=-1, keepdims=True)[0])
    rowsame(f"softmax {dt}", [mx.softmax(lg[:, i:i + 1], axis=-1).reshape(1, -1) for i in range(9)],
            mx.softmax(lg, axis=-1)[0])
    rowsame(f"argmax {dt}", [mx.argmax(lg[:, i:i + 1], axis=-1).reshape(1, -1) for i in range(9)],
            mx.argmax(lg, axis=-1)[0][:, None])
    e = mx.random.normal((5000, 1024)).astype(dt)
    ids = mx.array([3, 17, 4999, 0, 256], mx.uint32)
    rowsame(f"take {dt}", [e[ids[i:i + 1]] for i in range(5)], e[ids])

