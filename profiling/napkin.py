#!/usr/bin/env python3
"""napkin.py — the arithmetic behind profiling/napkin.md: FLOP and bytes of every phase of quantizing one
block (BoA 3-bit, per-channel, asymmetric: 200 search candidates), for Llama-2-7B and Llama-2-70B shapes and
the goal's calibration (128 sequences × 2048 tokens), and the time of each at the H200 rates napkin.md cites.
PROJECTED: no GPU has run this code. Prints the markdown tables napkin.md holds.

    python3 profiling/napkin.py            # both models
    python3 profiling/napkin.py --seqs 64  # another calibration size

Counting rules (napkin.md says why): a GEMM of m×k by k×n is 2·m·n·k flop; a Gram XᵀX of n columns over N rows
is N·n² flop (one triangle); a causal product (A lower-triangular T×T) is half of its dense count; a phase's
floor is the larger of its arithmetic time and its memory time; phases are summed (no overlap assumed, except
the weight upload, which the prefetch of the next block hides).
"""
import argparse

# Rates (napkin.md "Rates" cites the file and line of each).
BF16 = 788e12      # FLOP/s, bf16 dense GEMM through cuBLAS on random data (KINDS.md:17; 769–798 at :18)
F32 = 67e12        # FLOP/s, plain fp32 (H200.md:5: the datasheet's, a lead, not measured here)
HBM = 4.3e12       # B/s, device-to-device copy counting bytes read and written (KINDS.md:17, :18)
PCIE = 50e9        # B/s, page-locked host↔device: ASSUMED (PCIe Gen5 x16 is 64 GB/s raw; not in the files)
STEP = 1e-6        # s per dependent column step of a sweep: ASSUMED (design.md §6's goal, ≤ 5 ms for a
                   # 4096-column GPTQ sweep, is ≤ 1.2 µs per step)
BOA_STEP = 2e-6    # s per wavefront step of the BoA sweep: ASSUMED (design.md §6: goal ≤ 2× GPTQ's)

MODELS = {
    "7B": dict(d=4096, d_ff=11008, heads=32, kv_heads=32, dh=128, blocks=32),
    "70B": dict(d=8192, d_ff=28672, heads=64, kv_heads=8, dh=128, blocks=80),
}


def phases(m, seqs, T, bits=3, candidates=200, top=4):
    d, f, H, Hkv, dh = m["d"], m["d_ff"], m["heads"], m["kv_heads"], m["dh"]
    dkv = Hkv * dh
    N = seqs * T
    # (name, rows, cols) of each linear: rows = d_out, cols = d_in; q/k/v are BoA's, the rest GPTQ's.
    lin = [("q", d, d), ("k", dkv, d), ("v", dkv, d), ("o", d, d), ("gate", f, d), ("up", f, d), ("down", d, f)]
    boa = {"q", "k", "v"}
    params = sum(r * c for _, r, c in lin)
    rn2 = sum(r * c * c for _, r, c in lin)          # Σ rows·n²: one pass of a row-set through its Hessian
    rn = params

    out = []  # (phase, unit, flop, bytes, extra seconds, note)
    # Forward: the seven GEMMs with bf16 operands; attention (QKᵀ and A·V, causal) in the hand-written f32 kernel.
    gemm = 2 * N * params
    # Activation traffic per token, f32 elements read + written: q/k/v (d in, d + 2·dkv out), attention (q, k, v
    # in, d out), o (d, d), gate/up (d in, 2f out), SwiGLU (2f in, f out), down (f, d), 2 RMSNorms (2d each),
    # RoPE on q and k (2·(d + dkv)), 2 residual adds (3d each).
    act = (d + d + 2 * dkv) + (d + 2 * dkv + d) + 2 * d + (d + 2 * f) + 3 * f + (f + d) + 4 * d + 2 * (d + dkv) + 6 * d
    fwd_bytes = 4 * N * act + 2 * params  # + the bf16 weights, read once
    attn = 2 * seqs * H * T * T * dh       # 2 products × 2·T²·dh / 2 (causal) per head per sequence
    out.append(("FP forward: 7 GEMMs (bf16)", "bf16", gemm, fwd_bytes, 0, "2·N·params"))
    out.append(("FP forward: attention (f32 kernel)", "f32", attn, 0, 0, "2·S·H·T²·d_h (causal)"))
    # Statistics.
    grams = N * (3 * d * d + f * f)
    out.append(("XᵀX: attention, o and MLP inputs (d²), down's input (d_ff²)", "bf16", grams,
                2 * N * (3 * d + f) + 4 * (3 * d * d + f * f), 0, "N·n² each (one triangle)"))
    qk = 2 * N * dh * dh * (H + Hkv)
    out.append(("post-RoPE Q/K covariances per head (+ RoPE average)", "f32", qk, 4 * N * (d + dkv), 0,
                "2·N·d_h²·(H + H_kv); the average over positions is O(d_h²) per position"))
    ahx = seqs * H * T * T * (d + dh)
    out.append(("V: A_h X per query head per sequence", "bf16", ahx, 2 * N * d * H * 2, 0,
                "S·H·T²·(d + d_h): the scores QKᵀ and A_h·X, causal; A_h X written and read once in bf16"))
    vgram = H * N * d * d
    out.append(("V: Σ_seq (A_h X)ᵀ(A_h X), summed per KV head", "bf16", vgram, 4 * Hkv * d * d, 0, "H·N·d²"))
    # Not in the total: the other association, Σ_seq Xᵀ (Σ_{h∈g} A_hᵀA_h) X per KV head (napkin.md "V's H_col").
    g = H // Hkv
    alt = seqs * Hkv * (g * T ** 3 / 3 + g * T * T * dh + 2 * T * T * d + T * d * d)
    out.append(("(other order, not in the total) V: Xᵀ(Σ_h A_hᵀA_h)X per KV head", "bf16", alt, 0, -1,
                "S·H_kv·(g·T³/3 + g·T²·d_h + 2·T²·d + T·d²)"))
    # Factorizations: potrf, trtri, H⁻¹ = L⁻ᵀL⁻¹, potrf again: ~4/3·n³ per distinct H_col.
    facs = [d, d, d, f] + [d] * Hkv  # q/k share one, o, gate/up share one, down, V: one per KV head
    fac = sum(4 * n ** 3 / 3 for n in facs)
    out.append((f"factors: {len(facs)} H_col (potrf, trtri, L⁻ᵀL⁻¹, potrf)", "f32", fac,
                sum(4 * 4 * n * n for n in facs), 0, "4/3·n³ each; + (H + H_kv) 128² H_row factors: nil"))
    # Scale search v2: bf16 Δ·H for every candidate, then the exact f32 re-score of the `top` best.
    search = 2 * candidates * rn2
    # Per element per candidate: Δ written (2 B) and read by the GEMM (2 B), P written (4 B) and read (4 B), Δ read
    # again by the approximate score (2 B).
    out.append((f"scale search: Δ·H of {candidates} candidates (bf16)", "bf16", search, 14 * candidates * rn, 0,
                "2·200·Σ rows·n²"))
    out.append((f"scale search: exact re-score of the best {top} (f32 SGEMM)", "f32", 2 * top * rn2,
                (4 + 4 + 4 + 4) * top * rn, 0, "2·4·Σ rows·n²"))
    # Sweeps.
    g_rn2 = sum(r * c * c for n, r, c in lin if n not in boa)
    g_steps = sum(c for n, r, c in lin if n not in boa)
    out.append(("GPTQ sweeps (o, gate, up, down): trailing GEMMs + column steps", "f32", g_rn2, 0, g_steps * STEP,
                f"rows·n² flop, + {g_steps} column steps × {STEP * 1e6:.0f} µs = {g_steps * STEP * 1e3:.0f} ms"))
    b_rn2 = sum(r * c * c + r * dh * c for n, r, c in lin if n in boa)
    b_steps = sum(c + dh for n, r, c in lin if n in boa)
    out.append(("BoA sweeps (q, k, v): trailing GEMMs + wavefront steps", "f32", b_rn2, 0, b_steps * BOA_STEP,
                f"rows·n² + rows·d_h·n flop, + {b_steps} wavefront steps (d_in + d_h each) × "
                f"{BOA_STEP * 1e6:.0f} µs = {b_steps * BOA_STEP * 1e3:.0f} ms"))
    out.append(("error report: [W; ΔW]·H per linear (f32)", "f32", 4 * rn2, 0, 0,
                "2·(2·rows)·n²; nil if taken from the sweeps' losses"))
    out.append(("quantized forward (as the FP one)", "bf16", gemm + 0, fwd_bytes, 0, ""))
    out.append(("quantized forward: attention", "f32", attn, 0, 0, ""))
    packed = rn * bits / 8 + sum(r for _, r, _ in lin) * (2 + bits / 8)  # codes + an f16 scale and a zero per row
    out.append(("packing", "-", 0, 4 * rn + rn + packed, 0, "read f32 W and codes, write packed"))
    return out, params, packed, N


def seconds(unit, flop, nbytes, extra):
    rate = BF16 if unit == "bf16" else F32
    t_flop = flop / rate if flop else 0.0
    t_mem = nbytes / HBM
    return t_flop, t_mem, max(t_flop, t_mem) + extra


def table(name, m, seqs, T):
    rows, params, packed, N = phases(m, seqs, T)
    print(f"\n### {name}: d {m['d']}, d_ff {m['d_ff']}, {m['heads']} heads × {m['dh']}, {m['kv_heads']} KV heads; "
          f"{seqs} × {T} = {N} tokens (PROJECTED)\n")
    print("| phase | unit | TFLOP | GB moved | t(FLOP) ms | t(bytes) ms | floor ms | how counted |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    total = 0.0
    for ph, unit, flop, nbytes, extra, note in rows:
        aside = extra < 0  # a comparison row, not counted
        tf, tm, t = seconds(unit, flop, nbytes, max(extra, 0))
        if not aside:
            total += t
        gb = f"{nbytes / 1e9:.1f}" if nbytes else "–"
        tms = f"{tm * 1e3:.1f}" if nbytes else "–"
        floor = f"({t * 1e3:.0f})" if aside else f"{t * 1e3:.0f}"
        print(f"| {ph} | {unit} | {flop / 1e12:.2f} | {gb} | {tf * 1e3:.1f} | {tms} | {floor} | {note} |")
    up32, up16, down = 4 * params, 2 * params, packed
    print(f"| PCIe: weights up, f32 ({up32 / 1e9:.2f} GB; bf16 would be {up16 / 1e9:.2f}) | pcie | | {up32 / 1e9:.2f} | | "
          f"{up32 / PCIE * 1e3:.0f} | 0 (hidden by the prefetch) | at {PCIE / 1e9:.0f} GB/s, assumed |")
    print(f"| PCIe: packed 3-bit output down | pcie | | {down / 1e9:.3f} | | {down / PCIE * 1e3:.1f} | "
          f"{down / PCIE * 1e3:.1f} | |")
    total += down / PCIE
    print(f"| **device total per block** | | | | | | **{total * 1e3:.0f}** | sum of floors |")
    # Measured, not computed: napkin.md "Host share", "After" (7B-shaped, 128 × 2048 tokens, commit 82e780b).
    host = "≤ 2.7 s CPU, 4.2 s wall (2-core machine, emulator copies inside)" if m["d"] == 4096 else "not measured"
    print(f"| host share (measured on the emulator's null mode) | | | | | | **{host}** | napkin.md \"Host share\" |")
    print(f"| **per model ({m['blocks']} blocks), device only** | | | | | | **{total * m['blocks']:.0f} s** | |")
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    a = ap.parse_args()
    for name, m in MODELS.items():
        table(name, m, a.seqs, a.seqlen)


if __name__ == "__main__":
    main()
