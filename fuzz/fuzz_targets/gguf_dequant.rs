//! The GGUF tensor decoder (`dequant`) on arbitrary bytes, ggml type ids and element counts: an error is
//! fine; a panic, or a success with the wrong number of values, is not. The decodable types are F32, F16,
//! BF16, Q8_0, Q4_0 and Q4_1; every other id (the K-quants among them, not decoded yet) must be refused.
//! Input: byte 0 picks the type id (0..40, so unknown ids too), bytes 1..5 the element count (< 2^20),
//! the rest is the tensor's data.
#![no_main]

use boa_cuda::model::gguf::GgmlType;
use boa_cuda::model::gguf::dequant::{check_dequantizable, dequantize};
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
    match dequantize("fuzz", ty, bytes, n) {
        Ok(v) => assert_eq!(v.len(), n),
        Err(_) => assert!(check_dequantizable("fuzz", ty, bytes.len(), n).is_err()),
    }
});
