//! `--gguf-type`: the GGUF block type of each linear. Either one type for all (llama.cpp's `--pure`), or one
//! of llama.cpp's K-quant presets (its `llama_tensor_get_type_impl`, linears only; with its mixture-of-experts
//! rules: an expert's or shared expert's ffn_down counts its layer, and a model of exactly 8 experts gets
//! attn_k and attn_v in Q8_0 and attn_output in Q5_K for most presets). Either way a linear whose input width is not a whole number of the type's blocks
//! falls back as llama.cpp's `tensor_type_fallback` (llama-cpp-python 0.3.36's vendored llama.cpp) does:
//! Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0. So a file of ours and llama.cpp's quantization
//! of the same model with the same choice hold the same type in every tensor, and have the same size.
//! The linears' grids then come from the type's codec (model/gguf/codec.rs).

use crate::model::arch::Role;
use crate::model::gguf::GgmlType;
use crate::model::gguf::codec::codec;

/// llama.cpp's K-quant presets (`LLAMA_FTYPE_MOSTLY_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// llama.cpp's "Q2_K" (a mix: attn_v, attn_output and ffn_down in Q3_K).
    Q2K,
    Q2KS,
    Q3KS,
    Q3KM,
    Q3KL,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
}

/// What `--gguf-type` names (serialized as that name, e.g. "q4_k_m").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    /// Every linear this type (then the fallback).
    Pure(GgmlType),
    Preset(Preset),
}

const PURE: [(&str, GgmlType); 10] = [
    ("q4_0", GgmlType::Q4_0),
    ("q4_1", GgmlType::Q4_1),
    ("q5_0", GgmlType::Q5_0),
    ("q5_1", GgmlType::Q5_1),
    ("q8_0", GgmlType::Q8_0),
    ("q2_k", GgmlType::Q2_K),
    ("q3_k", GgmlType::Q3_K),
    ("q4_k", GgmlType::Q4_K),
    ("q5_k", GgmlType::Q5_K),
    ("q6_k", GgmlType::Q6_K),
];

const PRESETS: [(&str, Preset, u32); 9] = [
    ("q2_k_mix", Preset::Q2K, 10),
    ("q2_k_s", Preset::Q2KS, 21),
    ("q3_k_s", Preset::Q3KS, 11),
    ("q3_k_m", Preset::Q3KM, 12),
    ("q3_k_l", Preset::Q3KL, 13),
    ("q4_k_s", Preset::Q4KS, 14),
    ("q4_k_m", Preset::Q4KM, 15),
    ("q5_k_s", Preset::Q5KS, 16),
    ("q5_k_m", Preset::Q5KM, 17),
];

impl serde::Serialize for GgufType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl GgufType {
    pub fn parse(s: &str) -> Result<GgufType, String> {
        let t = s.trim().to_ascii_lowercase();
        if let Some(&(_, ty)) = PURE.iter().find(|e| e.0 == t) {
            return Ok(GgufType::Pure(ty));
        }
        if let Some(&(_, p, _)) = PRESETS.iter().find(|e| e.0 == t) {
            return Ok(GgufType::Preset(p));
        }
        Err(format!(
            "--gguf-type {s} is not known (one type for every linear: {}; llama.cpp's presets: {})",
            PURE.map(|e| e.0).join(", "),
            PRESETS.map(|e| e.0).join(", ")
        ))
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufType::Pure(ty) => PURE.iter().find(|e| e.1 == ty).map_or("?", |e| e.0),
            GgufType::Preset(p) => PRESETS.iter().find(|e| e.1 == p).map_or("?", |e| e.0),
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`) of a file made with this choice.
    pub fn file_type(self) -> u32 {
        match self {
            GgufType::Preset(p) => PRESETS.iter().find(|e| e.1 == p).map_or(0, |e| e.2),
            GgufType::Pure(ty) => match ty {
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 => 3,
                GgmlType::Q8_0 => 7,
                GgmlType::Q5_0 => 8,
                GgmlType::Q5_1 => 9,
                GgmlType::Q2_K => 10,
                GgmlType::Q3_K => 11,
                GgmlType::Q4_K => 14,
                GgmlType::Q5_K => 16,
                _ => 18, // Q6_K
            },
        }
    }

    /// The preset's (or pure) type before the per-tensor rules (llama.cpp's default type of the ftype).
    fn base(self) -> GgmlType {
        match self {
            GgufType::Pure(ty) => ty,
            GgufType::Preset(p) => match p {
                Preset::Q2K | Preset::Q2KS => GgmlType::Q2_K,
                Preset::Q3KS | Preset::Q3KM | Preset::Q3KL => GgmlType::Q3_K,
                Preset::Q4KS | Preset::Q4KM => GgmlType::Q4_K,
                Preset::Q5KS | Preset::Q5KM => GgmlType::Q5_K,
            },
        }
    }

    /// The type of the linear `role` of block `layer` (of `n_layers`) with `d_in` inputs, in a model with
    /// `n_gqa` query heads per KV head and `n_expert` experts per block (0 without experts).
    pub fn linear_type(
        self,
        role: Role,
        layer: usize,
        n_layers: usize,
        d_in: usize,
        n_gqa: usize,
        n_expert: usize,
    ) -> GgmlType {
        let ty = match self {
            GgufType::Pure(ty) => ty,
            GgufType::Preset(p) => {
                preset_type(p, self.base(), role, layer, n_layers, n_gqa, n_expert)
            }
        };
        fallback(ty, d_in)
    }

    /// Every type a linear of this choice can get (for checks before any work).
    pub fn types(self) -> Vec<GgmlType> {
        let mut out: Vec<GgmlType> = Vec::new();
        for role in [
            Role::Q,
            Role::K,
            Role::V,
            Role::O,
            Role::Gate,
            Role::Up,
            Role::Down,
        ] {
            for layer in 0..64 {
                for (d_in, n_expert) in [(256, 0), (32, 0), (256, 8), (32, 8)] {
                    let t = self.linear_type(role, layer, 64, d_in, 4, n_expert);
                    if !out.contains(&t) {
                        out.push(t);
                    }
                }
            }
        }
        out
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third in between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
}

/// llama.cpp's per-tensor rules of the K-quant presets (not 70B): attn_v counts its tensors in layer order,
/// so its index is the layer; ffn_down (an expert's stacked tensor or the shared expert's) takes its layer
/// from its name, over the model's layers. Exactly 8 experts (Mixtral 8x7B's count, which llama.cpp's rules
/// test for) put attn_k and attn_v in Q8_0 and attn_output in Q5_K for Q2_K, Q3_K_S/M and Q4_K_S/M; checked
/// against llama.cpp's own quantizer on random 8-expert Mixtral and Qwen2-MoE and a 4-expert Qwen3-MoE
/// (tests/gguf_export.rs).
fn preset_type(
    p: Preset,
    base: GgmlType,
    role: Role,
    i: usize,
    n: usize,
    n_gqa: usize,
    n_expert: usize,
) -> GgmlType {
    use GgmlType::*;
    if n_expert == 8 {
        match role {
            Role::K | Role::V => return Q8_0,
            Role::O => {
                return match p {
                    Preset::Q2K | Preset::Q3KS | Preset::Q3KM | Preset::Q4KS | Preset::Q4KM => Q5_K,
                    _ => base,
                };
            }
            _ => {}
        }
    }
    match role {
        Role::V => match p {
            Preset::Q2K => {
                if n_gqa >= 4 {
                    Q4_K
                } else {
                    Q3_K
                }
            }
            Preset::Q2KS if n_gqa >= 4 => Q4_K,
            Preset::Q3KM => {
                if i < 2 {
                    Q5_K
                } else {
                    Q4_K
                }
            }
            Preset::Q3KL => Q5_K,
            Preset::Q4KM | Preset::Q5KM if use_more_bits(i, n) => Q6_K,
            Preset::Q4KS if i < 4 => Q5_K,
            _ => base,
        },
        Role::Down => match p {
            Preset::Q2K => Q3_K,
            Preset::Q2KS if i < n / 8 => Q4_K,
            Preset::Q3KM => {
                if i < n / 16 {
                    Q5_K
                } else {
                    Q4_K
                }
            }
            Preset::Q3KL => Q5_K,
            Preset::Q4KM | Preset::Q5KM if use_more_bits(i, n) => Q6_K,
            Preset::Q4KS if i < n / 8 => Q5_K,
            _ => base,
        },
        Role::O => match p {
            Preset::Q2K => Q3_K,
            Preset::Q3KM => Q4_K,
            Preset::Q3KL => Q5_K,
            _ => base,
        },
        _ => base,
    }
}

/// llama.cpp's `tensor_type_fallback` for a row of `d_in` values.
pub fn fallback(ty: GgmlType, d_in: usize) -> GgmlType {
    if d_in.is_multiple_of(ty.block_size() as usize) {
        return ty;
    }
    match ty {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    }
}

/// Whether linears of type `ty` go through the codec's shard path (their grids are not GPTQ's); Q4_0 and
/// Q8_0 are GPTQ's symmetric 32-column grids and stay packed GPTQ tensors until the file is written.
pub fn via_codec(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0) && codec(ty).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_fallbacks_follow_llama_cpp() {
        for n in PURE.iter().map(|e| e.0).chain(PRESETS.iter().map(|e| e.0)) {
            assert_eq!(GgufType::parse(n).unwrap().name(), n);
        }
        assert!(GgufType::parse("q4_k_x").is_err());
        // SmolLM2: d_in 576 (q/k/v/o/gate/up) is not a multiple of 256, 1536 (down) is.
        let t = GgufType::parse("q4_k").unwrap();
        assert_eq!(t.linear_type(Role::Q, 0, 30, 576, 3, 0), GgmlType::Q5_0);
        assert_eq!(t.linear_type(Role::Down, 0, 30, 1536, 3, 0), GgmlType::Q4_K);
        let t = GgufType::parse("q2_k").unwrap();
        assert_eq!(t.linear_type(Role::Up, 5, 30, 576, 3, 0), GgmlType::Q4_0);
        assert_eq!(t.linear_type(Role::Down, 5, 30, 1536, 3, 0), GgmlType::Q2_K);
        // Q4_K_M: ffn_down and attn_v in Q6_K on use_more_bits layers (0..3, 26..29, and 5, 8, …).
        let m = GgufType::parse("q4_k_m").unwrap();
        let down: Vec<usize> = (0..30)
            .filter(|&l| m.linear_type(Role::Down, l, 30, 4096, 8, 0) == GgmlType::Q6_K)
            .collect();
        assert_eq!(down, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
        assert_eq!(m.linear_type(Role::Q, 3, 30, 4096, 8, 0), GgmlType::Q4_K);
        assert_eq!(m.linear_type(Role::V, 3, 30, 576, 3, 0), GgmlType::Q5_0);
        assert_eq!(m.linear_type(Role::V, 0, 30, 576, 3, 0), GgmlType::Q8_0);
        // Mixtral 8x7B's rules: attn_k and attn_v Q8_0, attn_output Q5_K (Q3_K_L keeps its Q3_K).
        assert_eq!(m.linear_type(Role::K, 3, 32, 4096, 4, 8), GgmlType::Q8_0);
        assert_eq!(m.linear_type(Role::O, 3, 32, 4096, 4, 8), GgmlType::Q5_K);
        let l = GgufType::parse("q3_k_l").unwrap();
        assert_eq!(l.linear_type(Role::O, 3, 32, 4096, 4, 8), GgmlType::Q3_K);
        assert_eq!(l.linear_type(Role::O, 3, 32, 4096, 4, 4), GgmlType::Q5_K);
    }
}
