//! The GGUF tensor decoders (`dequant`, `kquant`) on arbitrary bytes, ggml type ids and element counts: an
//! error is fine; a panic, or a success with the wrong number of values, is not. The decodable types
//! (`dequant::SUPPORTED`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K…Q6_K) must decode every byte
//! pattern of the right size; every other id (Q8_1, Q8_K, IQ*, TQ*, MXFP4) and every wrong size must be
//! refused. Input: byte 0 picks the type id (0..40, so unknown ids too), bytes 1..5 the element count
//! (< 2^20), the rest is the tensor's data.
#![no_main]

use boa_cuda::model::gguf::GgmlType;
use boa_cuda::model::gguf::dequant::{SUPPORTED, check_dequantizable, dequantize};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 5 {
        return;
    }
    let Some(ty) = GgmlType::from_id(data[0] as u32 % 40) else {
        return;
    };
    let n = u32::from_le_bytes([data[1], data[2], data[3], data[4]]) as usize % (1 << 20);
    let bytes = &data[5..];
    let (block, size) = (ty.block_size() as usize, ty.type_size() as usize);
    let well_sized = n % block == 0 && bytes.len() == n / block * size;
    match dequantize("fuzz", ty, bytes, n) {
        Ok(v) => assert!(v.len() == n && SUPPORTED.contains(&ty) && well_sized),
        Err(_) => {
            assert!(check_dequantizable("fuzz", ty, bytes.len(), n).is_err());
            assert!(!(SUPPORTED.contains(&ty) && well_sized));
        }
    }
});
