#!/usr/bin/env python3
"""Why llama.cpp with an importance matrix beats our GPTQ in GGUF (README, "GGUF"): a proxy on round to
nearest. For Q4_0 (32-value blocks, levels -8..7, signed-max scale d = max/-8), the importance-weighted error
sum_j h_j (w_j - d q_j)^2 of every block (h: the imatrix of scripts/llamacpp_imatrix.py, mean x_j^2) under
  minmax         d = max/-8;
  shrink         the best of 100 shrinks of that d (what our grid search does, with H's diagonal here);
  shrink+refit   then the weighted least-squares d for the rounded codes, re-rounded, 3 rounds (what
                 llama.cpp's make_qx_quants adds);
  positive       our search without signed scales: d = 2m/15 > 0 from the symmetric range m = max|w| (levels
                 -8..7: a positive extreme is clipped at 7d), 100 shrinks;
  signed         our search with signed scales (--signed-scales): the better of d and -d per block.
Every 5th layer's seven linears; totals relative to shrink.

usage: gguf_scale_refit.py MODEL.safetensors IMATRIX.npz     (reference venv: numpy, safetensors)
"""
import sys

import numpy as np
from safetensors.numpy import load_file

W = load_file(sys.argv[1])
im = dict(np.load(sys.argv[2]))
GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down"}
n_layers = 1 + max(int(k.split(".")[2]) for k in W if k.startswith("model.layers."))


def codes(w, s):
    return np.clip(np.rint(w / np.where(s == 0, 1, s)), -8, 7)


tot = {"minmax": 0.0, "shrink": 0.0, "shrink+refit": 0.0, "positive": 0.0, "signed": 0.0}
for layer in range(0, n_layers, 5):
    for hf, g in GGUF.items():
        w = W[f"model.layers.{layer}.{hf}.weight"].astype(np.float64)
        d_out, d_in = w.shape
        wb = w.reshape(d_out, d_in // 32, 32)
        hb = np.broadcast_to(im[f"blk.{layer}.{g}.weight"].astype(np.float64).reshape(1, d_in // 32, 32), wb.shape)
        mx = np.take_along_axis(wb, np.argmax(np.abs(wb), axis=-1)[..., None], -1)

        def err(s):
            return (hb * (wb - s * codes(wb, s)) ** 2).sum(-1, keepdims=True)

        base = mx / -8.0
        e_mm = err(base)
        best_s, best_e = base.copy(), e_mm.copy()
        for p in np.linspace(1.0, 0.2, 100)[1:]:
            e = err(base * p)
            keep = e < best_e
            best_s, best_e = np.where(keep, base * p, best_s), np.where(keep, e, best_e)
        rs, r_e = best_s.copy(), best_e.copy()
        for _ in range(3):
            q = codes(wb, rs)
            den = (hb * q * q).sum(-1, keepdims=True)
            s2 = np.where(den > 0, (hb * wb * q).sum(-1, keepdims=True) / np.where(den > 0, den, 1), rs)
            e2 = err(s2)
            keep = e2 < r_e
            rs, r_e = np.where(keep, s2, rs), np.where(keep, e2, r_e)
        m = np.abs(wb).max(-1, keepdims=True)
        best = {}
        for sign in (1.0, -1.0):
            base_s = sign * 2.0 * m / 15.0
            be = err(base_s)
            for p in 1.0 - np.arange(1, 100) / 100.0:
                be = np.minimum(be, err(base_s * p))
            best[sign] = be
        tot["positive"] += best[1.0].sum()
        tot["signed"] += np.minimum(best[1.0], best[-1.0]).sum()
        tot["minmax"] += e_mm.sum()
        tot["shrink"] += best_e.sum()
        tot["shrink+refit"] += r_e.sum()
for k, v in tot.items():
    print(f"{k:14s} {v:.6e}  ({v / tot['shrink']:.4f} of shrink)")
