#!/usr/bin/env python3
"""Emulates causal_attention_tile<kD> (cuda/ops.cu, the flash v2 kernels) thread by thread on the CPU with numpy:
the same CTA grid, thread → (query row, dim slice) map, 32-key smem tiles, xor-shuffle score reduction, causal
mask and online softmax, in float32, against a float64 reference. It checks the kernel's index math and
tiling without a GPU (written 2026-11-30, when no GPU was available); it cannot check CUDA semantics (barriers,
shuffles' masks, memory model) -- tests/parity_ops.rs on a GPU does. Keep it in step with the kernel, or
delete it once the GPU parity test has passed.

    python3 profiling/emulate_causal_attention.py      # prints the rel. error per shape, fails above 2e-5
"""
import numpy as np

QS, TPQ, KEYS = 64, 4, 32  # kAttnQueries, kAttnThreadsPerQuery, kAttnKeys


def kernel(q, k, v, n_seq, t, h, h_kv, d_h):
    kd = 64 if d_h <= 64 else 128
    sl = kd // TPQ
    o = np.full(q.shape, np.nan, np.float32)  # poisoned, like the parity test
    scale = np.float32(1.0 / np.sqrt(np.float32(d_h)))
    q_stride, kv_stride = h * d_h, h_kv * d_h
    qf, kf, vf, of = q.ravel(), k.ravel(), v.ravel(), o.ravel()
    tid = np.arange(QS * TPQ)
    r, g = tid // TPQ, tid % TPQ
    for s in range(n_seq):
        for hd in range(h):
            kv = hd // (h // h_kv)
            for bx in range((t + QS - 1) // QS):
                q0 = bx * QS
                i = q0 + r
                live = i < t
                q_rg = np.zeros((QS * TPQ, sl), np.float32)
                acc = np.zeros((QS * TPQ, sl), np.float32)
                for c in range(sl):
                    d = c * TPQ + g
                    ok = live & (d < d_h)
                    idx = np.where(ok, (s * t + i) * q_stride + hd * d_h + d, 0)
                    q_rg[:, c] = np.where(ok, qf[idx] * scale, 0).astype(np.float32)
                m = np.full(QS * TPQ, -np.inf, np.float32)
                l = np.zeros(QS * TPQ, np.float32)
                for j0 in range(0, min(q0 + QS, t), KEYS):
                    k_sh = np.zeros((KEYS, kd), np.float32)
                    v_sh = np.zeros((KEYS, kd), np.float32)
                    for e in range(KEYS * kd):
                        jj, d = e // kd, e % kd
                        j = j0 + jj
                        if j < t and d < d_h:
                            base = s * t * kv_stride + kv * d_h + j * kv_stride + d
                            k_sh[jj, d], v_sh[jj, d] = kf[base], vf[base]
                    sc = np.zeros((QS * TPQ, KEYS), np.float32)
                    for jj in range(KEYS):
                        part = np.zeros(QS * TPQ, np.float32)
                        for c in range(sl):
                            part = (part + q_rg[:, c] * k_sh[jj, c * TPQ + g]).astype(np.float32)
                        part = part + part[tid ^ 1]
                        part = part + part[tid ^ 2]
                        sc[:, jj] = np.where(j0 + jj <= i, part, -np.inf)
                    m_new = np.maximum(m, sc.max(axis=1))
                    assert np.all(np.isfinite(m_new)), "running max must be finite from the first tile on"
                    corr = np.exp(m - m_new).astype(np.float32)
                    l, acc = l * corr, acc * corr[:, None]
                    for jj in range(KEYS):
                        pj = np.exp(sc[:, jj] - m_new).astype(np.float32)
                        l = l + pj
                        for c in range(sl):
                            acc[:, c] = acc[:, c] + pj * v_sh[jj, c * TPQ + g]
                    m = m_new
                for th in np.nonzero(live)[0]:
                    for c in range(sl):
                        d = c * TPQ + g[th]
                        if d < d_h:
                            of[(s * t + i[th]) * q_stride + hd * d_h + d] = acc[th, c] / l[th]
    return o


def reference(q, k, v, n_seq, t, h, h_kv, d_h):
    q = q.astype(np.float64).reshape(n_seq, t, h, d_h)
    k = k.astype(np.float64).reshape(n_seq, t, h_kv, d_h)
    v = v.astype(np.float64).reshape(n_seq, t, h_kv, d_h)
    o = np.zeros_like(q)
    for s in range(n_seq):
        for hd in range(h):
            kv = hd // (h // h_kv)
            sc = q[s, :, hd] @ k[s, :, kv].T / np.sqrt(d_h)
            sc[np.triu_indices(t, 1)] = -np.inf
            p = np.exp(sc - sc.max(1, keepdims=True))
            o[s, :, hd] = (p / p.sum(1, keepdims=True)) @ v[s, :, kv]
    return o.reshape(n_seq * t, h * d_h)


def main():
    rng = np.random.default_rng()
    for n_seq, t, h, h_kv, d_h in [(1, 1, 1, 1, 64), (2, 70, 4, 2, 64), (1, 129, 2, 1, 128), (1, 65, 2, 1, 80),
                                   (1, 20, 3, 1, 17), (2, 33, 2, 2, 32)]:
        row_scale = 10 ** rng.uniform(-1, 1, (n_seq * t, 1))
        q = (rng.uniform(-1, 1, (n_seq * t, h * d_h)) * row_scale).astype(np.float32)
        k = rng.uniform(-1, 1, (n_seq * t, h_kv * d_h)).astype(np.float32)
        v = rng.uniform(-1, 1, (n_seq * t, h_kv * d_h)).astype(np.float32)
        o, ref = kernel(q, k, v, n_seq, t, h, h_kv, d_h), reference(q, k, v, n_seq, t, h, h_kv, d_h)
        err = np.sqrt(((o - ref) ** 2).sum() / (ref ** 2).sum())
        print(f"n_seq={n_seq} t={t} h={h} h_kv={h_kv} d_h={d_h}: rel. error {err:.3e}")
        assert err <= 2e-5, "emulated flash kernel disagrees with the reference (NaN = unwritten output)"


if __name__ == "__main__":
    main()
