#!/usr/bin/env python3
"""A compressed-tensors checkpoint written by compressed-tensors itself (tests/transformers_parity.rs:
`boa-cuda eval` and `inspect` must read what llm-compressor's format library writes, not only our output).

Loads MODEL_DIR in transformers (float32), attaches a W{B}A16 scheme to every Linear but lm_head with
compressed-tensors' `apply_quantization_config`, sets each weight's min-max scale and zero point with its own
`calculate_qparams` (groups of --group-size columns, or per channel with -1; --asym for a zero point), then
compresses with `ModelCompressor` in the pack-quantized format and saves: what llm-compressor's save path does
after its calibration (its observers and GPTQ choose other scales; the layout and config are the same).

usage: ct_compress.py MODEL_DIR OUT_DIR --bits B --group-size G [--asym]
needs: the venv of scripts/install_loaders.sh.
"""
import argparse, os, sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--asym", action="store_true")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    group = a.group_size > 0
    args = QuantizationArgs(num_bits=a.bits, type="int", symmetric=not a.asym,
                            strategy="group" if group else "channel",
                            group_size=a.group_size if group else None, dynamic=False)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight
            d_out, d_in = w.shape
            g = a.group_size if group else d_in
            wg = w.reshape(d_out, d_in // g, g)
            scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape))
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(a.out)
    compressor.update_config(a.out)
    tok = os.path.join(a.model, "tokenizer.json")
    if os.path.exists(tok):
        import shutil
        shutil.copy(tok, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
