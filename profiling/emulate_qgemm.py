#!/usr/bin/env python3
"""Emulates qgemm_fused<BITS, MT, GIDX> and qgemm_dequant<BITS> (cuda/qgemm.cu) on the CPU with numpy, vectorised
over a CTA's 128 threads: the launch plan of fused_plan (src/backend/cuda/qgemm.rs), the staging of X pre-scaled
by 2^-p, the unpacking windows (funnel shifts), the 2^23 bit-pattern trick, the per-group zero constants, the
group flushes, the g_idx path and the split-K partials summed in split order, all in float32, against a float64
reference. It checks the kernels' index and bit math without a GPU (written 2026-11-30, when no GPU was
available); it cannot check CUDA semantics (barriers, fences, the counter) -- tests/parity_qgemm.rs on a GPU does.
Keep it in step with the kernels, or delete it once the GPU parity test has passed.

    python3 profiling/emulate_qgemm.py      # prints the rel. error per case, fails above 1e-5
"""
import numpy as np

THREADS, SR, SMEM, TILES, SMS, CTAS = 128, 32, 48 * 1024, [1, 2, 4, 8, 16], 132, 8
M32 = np.uint64(0xFFFFFFFF)


def pack(codes, bits):
    """codes [k × n] -> qweight [ceil(k·b/32) × n] u32, LSB-first along k (boa_pack_code)."""
    k, n = codes.shape
    kw = (k * bits + 31) // 32
    qw = np.zeros((kw, n), np.uint64)
    for i in range(k):
        bit = i * bits
        w, off = bit // 32, bit % 32
        qw[w] |= (codes[i].astype(np.uint64) << np.uint64(off)) & M32
        if off + bits > 32:
            qw[w + 1] |= codes[i].astype(np.uint64) >> np.uint64(32 - off)
    return qw.astype(np.uint32)


def plan(m, k, n, gidx, sms=SMS):
    tile = next(t for t in TILES if t >= m)
    nsr, nb = -(-k // SR), -(-n // THREADS)
    per_sr = SR * 4 * (tile + int(gidx))
    max_spb = SMEM // per_sr
    per_sm = CTAS if tile <= 4 else CTAS // 2
    want = max(-(-(sms * per_sm) // nb), 1)
    spb = max(min(max(-(-nsr // want), 1), max_spb), -(-nsr // 65535))
    return tile, spb, -(-nsr // spb), nb


def f32(v):
    return np.float32(v)


def fused(x, qw, scales, zeros, g_idx, m, k, n, bits, group_sr):
    gidx = group_sr is None
    tile, spb, splits, nb = plan(m, k, n, gidx)
    C = 23 // bits
    mask = np.uint32((1 << bits) - 1)
    kw = qw.shape[0]
    nsr = -(-k // SR)
    part = np.full((splits, m, n), np.nan, np.float32)
    for bx in range(nb):
        j = bx * THREADS + np.arange(THREADS)
        ok = j < n
        jj = np.where(ok, j, 0)
        for split in range(splits):
            sr0 = split * spb
            sr1 = min(sr0 + spb, nsr)
            assert sr1 > sr0, "empty split"
            ln, k0 = (sr1 - sr0) * SR, sr0 * SR
            assert ln * 4 * (tile + int(gidx)) <= SMEM
            x_sh = np.zeros(ln * tile, np.float32)
            for e in range(ln * tile):
                r, t = e // tile, e % tile
                i = k0 + r
                p = bits * ((r % SR) % C)
                if t < m and i < k:
                    x_sh[e] = f32(x[t, i] * f32(2.0 ** -p))
            g_sh = np.array([g_idx[k0 + r] if k0 + r < k else 0 for r in range(ln)], np.uint32)
            y_acc = np.zeros((tile, THREADS), np.float32)
            acc = np.zeros((tile, THREADS), np.float32)
            kp = np.full((C, THREADS), 2.0 ** 23, np.float32)
            s_cur = np.zeros(THREADS, np.float32)
            g_cur = -1
            for sr in range(sr0, sr1):
                wd = [qw[sr * bits + w, jj] if sr * bits + w < kw else np.zeros(THREADS, np.uint32)
                      for w in range(bits)]
                if not gidx:
                    g = sr // group_sr
                    if g != g_cur:
                        y_acc = (s_cur * acc + y_acc).astype(np.float32)  # fmaf, rounded once in float32
                        acc[:] = 0
                        g_cur = g
                        s_cur = scales[g, jj]
                        z = zeros[g, jj]
                        for c in range(C):
                            kp[c] = (z * f32(2.0 ** (bits * c)) + f32(2.0 ** 23)).astype(np.float32)
                v = None
                for c in range(SR):
                    cw = c % C
                    if cw == 0:
                        s = bits * c
                        lo, sh = s // 32, s % 32
                        if lo + 1 < bits:  # __funnelshift_r(wd[lo], wd[lo+1], sh)
                            both = (wd[lo + 1].astype(np.uint64) << np.uint64(32)) | wd[lo].astype(np.uint64)
                            v = ((both >> np.uint64(sh)) & M32).astype(np.uint32)
                        else:
                            v = wd[lo] >> np.uint32(sh)
                    fb = np.uint32(0x4B000000) | (v & (mask << np.uint32(bits * cw)))
                    fv = fb.view(np.float32)
                    if gidx:
                        g = g_sh[(sr - sr0) * SR + c]
                        s, z = scales[g, jj], zeros[g, jj]
                        kz = (z * f32(2.0 ** (bits * cw)) + f32(2.0 ** 23)).astype(np.float32)
                        d = ((fv - kz) * s).astype(np.float32)
                    else:
                        d = (fv - kp[cw]).astype(np.float32)
                    xr = x_sh[((sr - sr0) * SR + c) * tile:((sr - sr0) * SR + c + 1) * tile]
                    acc = (xr[:, None].astype(np.float64) * d + acc).astype(np.float32)
            if gidx:
                y_acc = acc
            else:
                y_acc = (s_cur * acc + y_acc).astype(np.float32)
            part[split][:, j[ok]] = y_acc[:m, ok]
    y = np.zeros((m, n), np.float32)
    for sp in range(splits):  # the last CTA's fixed order
        y = (y + part[sp]).astype(np.float32)
    return y, splits


def dequant(qw, scales, zeros, g_idx, k, n, bits):
    """qgemm_dequant: thread (j, sr) unpacks its super-row like boa_unpack_code."""
    w = np.full((n, k), np.nan, np.float32)
    kw = qw.shape[0]
    mask = (1 << bits) - 1
    for sr in range(-(-k // SR)):
        wd = [qw[sr * bits + i] if sr * bits + i < kw else np.zeros(n, np.uint32) for i in range(bits)]
        for c in range(SR):
            i = sr * SR + c
            if i >= k:
                break
            bit = bits * c
            lo, off = bit // 32, bit % 32
            v = (wd[lo] >> np.uint32(off)).astype(np.uint64)
            if off + bits > 32:
                v |= (wd[lo + 1].astype(np.uint64) << np.uint64(32 - off)) & M32
            q = (v & np.uint64(mask)).astype(np.float32)
            g = g_idx[i]
            w[:, i] = scales[g] * (q - zeros[g])
    return w


def main():
    rng = np.random.default_rng(0)
    worst = 0.0
    cases = [  # (m, k, n, bits, group (0 = per channel), act_order)
        (1, 200, 131, 4, 0, False), (3, 576, 129, 3, 64, False), (1, 4096, 256, 4, 128, False),
        (16, 333, 77, 2, 32, False), (4, 256, 300, 8, 128, False), (17, 160, 65, 3, 32, True),
        (2, 200, 129, 2, 48, False), (1, 1000, 100, 3, 128, True), (8, 96, 33, 8, 0, False),
    ]
    for m, k, n, bits, group, act in cases:
        g = group or k
        ng = -(-k // g)
        maxq = (1 << bits) - 1
        codes = rng.integers(0, maxq + 1, (k, n), dtype=np.uint32)
        scales = (rng.random((ng, n)) * 0.02 + 0.005).astype(np.float16).astype(np.float32)
        zeros = rng.integers(0, maxq + 1, (ng, n)).astype(np.float32)
        g_idx = np.arange(k, dtype=np.uint32) // g
        if act:
            g_idx = g_idx[rng.permutation(k)]
        x = (rng.random((m, k)) - 0.5).astype(np.float32)
        qw = pack(codes, bits)
        w = scales[g_idx].T.astype(np.float64) * (codes.T.astype(np.float64) - zeros[g_idx].T)  # [n × k]
        ref = x.astype(np.float64) @ w.T
        contiguous = not act and (ng == 1 or g % 32 == 0)
        group_sr = (-(-k // SR) if ng == 1 else g // SR) if contiguous else None
        paths = []
        if m <= 16:
            y, splits = fused(x, qw, scales, zeros, g_idx, m, k, n, bits, group_sr)
            paths.append((f"fused{'_gidx' if group_sr is None else ''} splits={splits}", y))
        wh = dequant(qw, scales, zeros, g_idx, k, n, bits)
        paths.append(("dequant", (x.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)))
        for name, y in paths:
            err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            print(f"m={m:2} k={k:4} n={n:3} {bits}-bit g={group:3} act_order={act!s:5} {name:24} rel. error {err:.2e}")
            assert err <= 1e-5, "emulated kernel disagrees with the reference"
    print(f"PASS: worst rel. error {worst:.2e}")


if __name__ == "__main__":
    main()
