#!/usr/bin/env python3
"""Emulates the scale search's variants (cuda/search.cu, src/backend/cuda/search.rs) with numpy on realistic
data and measures how close each variant's choice is to the f64 optimum of Δ H Δᵀ over the same candidates:

  v1 F32          score = s²·vᵀHv − 2s·vᵀ(Hw), P = V·H in f32 (SGEMM), f64 dots: drops wᵀHw, so its rounding
                  error scales with wᵀHw (the cancellation the bf16 variant must avoid);
  v2 Bf16Rescore  D = fl32(fl32(s·v) − w) rounded to bf16 (RNE), H rounded to bf16, P = D·H with f32
                  accumulation (cublasGemmEx), approx = Σ P·D; each row keeps the TOP best approximate scores
                  (ties: lower slot first) and re-scores those exactly: D in f32, P = D·H in f32 (SGEMM),
                  Σ P·D in f64; the least (score, slot) wins;
  approx only     v2 without the re-score (what the re-score buys).

The candidate set mirrors quant::quantizer::search_candidates in f32 (range [min(w,0), max(w,0)], p = f32(1 −
i/100), s = (p·hi − p·lo)/maxq, z = floor/ceil(−p·lo/s), 1/s in f32, v = clamp(rint(w·(1/s)), −z, maxq − z)),
the reference is tests/parity_quant.rs's grid_err (Δ = f64(fl32(s·v)) − w, Δ H Δᵀ in f64 over the f32 H).
numpy's f32 matmul stands in for cuBLAS's f32 accumulation (another summation order; both ~1e-7 relative).

H is built like a real H_col: X = (G·M)∘c + noise, G [N × r] Gaussian, M [r × n], c lognormal channel scales
(outlier channels), H = XᵀX/N + 1e-2·mean(diag)·I (GPTQ's damping); "lowrank" takes N = n/2 + 1 plain
uniform samples as the parity test's spd_lowrank does. W rows: Gaussian with per-row scales, a skew and an
outlier now and then.

    python3 profiling/emulate_search_bf16.py          # ~10 minutes on 2 cores; prints one line per case
"""
import sys

import numpy as np

SHRINK_STEPS = 100
REL_TOL = 1e-5  # tests/parity_quant.rs SEARCH_REL_TOL


def bf16(x):
    """f32 → bf16 (round to nearest even) → f32, as __float2bfloat16_rn."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32)


def candidates(w, maxq, sym):
    """[slots] scale, inv, zero (NaN = absent ceil slot), in search order."""
    f = np.float32
    lo, hi = f(min(w.min(), 0)), f(max(w.max(), 0))
    if sym:
        hi = max(hi, -lo)
        lo = -hi
    if lo == 0 and hi == 0:
        lo, hi = f(-1), f(1)
    mq = f(maxq)
    sc, zs = [], []
    for i in range(SHRINK_STEPS):
        p = f(1.0 - i / SHRINK_STEPS)
        l, h = f(p * lo), f(p * hi)
        s = f(f(h - l) / mq)
        if sym:
            sc.append(s)
            zs.append(f((mq + 1) / 2))
        else:
            z = f(-l / s)
            sc += [s, s]
            zs += [np.floor(z), np.ceil(z) if np.ceil(z) != np.floor(z) else np.nan]
    s = np.array(sc, np.float32)
    return s, (f(1) / s).astype(np.float32), np.array(zs, np.float32)


def vectors(w, s, inv, z, maxq):
    """V [slots × n] f32 integers (absent slots: 0)."""
    rho = np.rint((w[None, :] * inv[:, None]).astype(np.float32))
    zz = np.nan_to_num(z)[:, None]
    v = np.clip(rho, -zz, maxq - zz).astype(np.float32)
    v[np.isnan(z)] = 0
    return v


def case(rng, name, rows, n, bits, sym, lowrank, tops):
    maxq = (1 << bits) - 1
    if lowrank:
        m = n // 2 + 1
        x = rng.uniform(-1, 1, (m, n))
    else:
        m, r = 2 * n, max(n // 16, 8)
        c = np.exp(rng.normal(0, 1, n))
        x = (rng.normal(size=(m, r)) @ rng.normal(size=(r, n)) / np.sqrt(r) + 0.3 * rng.normal(size=(m, n))) * c
    h64 = x.T @ x / m
    h64 += 1e-2 * np.trace(h64) / n * np.eye(n)
    h = h64.astype(np.float32)
    hd = h.astype(np.float64)
    hb = bf16(h)
    W = []
    for r in range(rows):
        sc = 0.01 * (1 + r % 7)
        row = rng.normal(0, sc, n) + (0.5 * sc if r % 3 == 0 else 0)
        if r % 11 == 5:
            row[r % n] *= 8
        W.append(row.astype(np.float32))
    stats = {"v1": [], "approx": []}
    stats.update({f"top{t}": [] for t in tops})
    ranks, rel_err = [], []
    for w in W:
        s, inv, z = candidates(w, maxq, sym)
        ok = ~np.isnan(z)
        v = vectors(w, s, inv, z, maxq)
        sv = (s[:, None] * v).astype(np.float32)
        d64 = sv.astype(np.float64) - w.astype(np.float64)[None, :]
        exact = np.einsum("cj,cj->c", d64 @ hd, d64)
        exact[~ok] = np.inf
        best = exact.min()
        # v1
        u = v @ h
        hw = (w[None, :] @ h)[0]
        a = np.einsum("cj,cj->c", u.astype(np.float64), v.astype(np.float64))
        b = v.astype(np.float64) @ hw.astype(np.float64)
        sd = s.astype(np.float64)
        v1 = sd * sd * a - 2 * sd * b
        v1[~ok] = np.inf
        stats["v1"].append(exact[int(np.argmin(v1))] / best - 1)
        # v2 approximate scores
        d32 = (sv - w[None, :]).astype(np.float32)
        db = bf16(d32)
        p = db @ hb
        approx = np.einsum("cj,cj->c", p.astype(np.float64), db.astype(np.float64))
        approx = approx.astype(np.float32).astype(np.float64)  # the kernel keeps f32 approximate scores
        approx[~ok] = np.inf
        rel_err.append(np.max(np.abs(approx[ok] - exact[ok]) / exact[ok]))
        order = np.lexsort((np.arange(len(approx)), approx))  # by score, then slot
        opt = int(np.argmin(exact))
        ranks.append(int(np.where(order == opt)[0][0]))
        stats["approx"].append(exact[order[0]] / best - 1)
        for t in tops:
            cand = np.sort(order[:t])
            pr = (d32[cand] @ h).astype(np.float64)
            sc = np.einsum("cj,cj->c", pr, d32[cand].astype(np.float64))
            pick = cand[int(np.argmin(sc))]  # argmin: first of equal scores in slot order
            stats[f"top{t}"].append(exact[pick] / best - 1)
    cond = np.linalg.cond(hd) if n <= 1024 else float("nan")
    out = [f"{name:>8} rows={rows} n={n} b={bits} sym={int(sym)} cond(H)={cond:.1e}",
           f"approx rel.err max {max(rel_err):.1e}",
           f"optimum's rank in approx order: max {max(ranks)}, >=4: {sum(r >= 4 for r in ranks)}, "
           f">=8: {sum(r >= 8 for r in ranks)}"]
    for k, e in stats.items():
        e = np.array(e)
        out.append(f"{k}: worst excess {e.max():.1e}, over {REL_TOL:.0e} in {int((e > REL_TOL).sum())}/{rows}, "
                   f"non-optimal {int((e > 0).sum())}")
    print(" | ".join(out), flush=True)
    return stats, ranks


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    tops = [1, 2, 4, 8]
    allr = []
    for name, rows, n, bits, sym, lowrank in [
        ("corr", 24, 1024, 4, False, False),
        ("corr", 24, 1024, 3, False, False),
        ("corr", 24, 1024, 2, False, False),
        ("corr", 24, 1024, 4, True, False),
        ("lowrank", 24, 1024, 3, False, True),
        ("lowrank", 24, 1024, 4, True, True),
        ("corr", 8, 2048, 3, False, False),
        ("corr", 8, 2048, 2, False, False),
    ]:
        _, ranks = case(rng, name, rows, n, bits, sym, lowrank, tops)
        allr += ranks
    print(f"all rows: {len(allr)}, optimum's approx rank max {max(allr)}, "
          f"histogram {np.bincount(allr).tolist()}")


if __name__ == "__main__":
    main()
