//! Token windows: consecutive non-overlapping windows for evaluation, seeded random windows for calibration.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Non-overlapping windows of `seqlen` tokens from the start (the trailing remainder is dropped), at most
/// `max_windows` of them. Errors when the text holds not even one window.
pub fn eval_windows(
    tokens: &[u32],
    seqlen: usize,
    max_windows: Option<usize>,
) -> anyhow::Result<Vec<&[u32]>> {
    if seqlen < 2 {
        return Err(crate::input_err!(
            "--seqlen must be at least 2 (got {seqlen})"
        ));
    }
    check_max_windows(max_windows)?;
    let n = tokens.len() / seqlen;
    if n == 0 {
        return Err(crate::input_err!(
            "the text has {} tokens, fewer than one window of --seqlen {seqlen}",
            tokens.len()
        ));
    }
    Ok(tokens
        .chunks_exact(seqlen)
        .take(max_windows.unwrap_or(n).min(n))
        .collect())
}

/// `--max-windows 0` would evaluate nothing (and divide by zero windows).
pub fn check_max_windows(max_windows: Option<usize>) -> anyhow::Result<()> {
    if max_windows == Some(0) {
        return Err(crate::input_err!(
            "--max-windows 0 evaluates nothing (use at least 1, or leave it out for every window)"
        ));
    }
    Ok(())
}

/// `n` windows of `seqlen` tokens at random offsets drawn from a ChaCha8 stream seeded with `seed`.
/// Errors when the text is shorter than one window.
pub fn calibration_windows(
    tokens: &[u32],
    n: usize,
    seqlen: usize,
    seed: u64,
) -> anyhow::Result<Vec<Vec<u32>>> {
    if tokens.len() <= seqlen {
        return Err(crate::input_err!(
            "the calibration text has {} tokens; --seqlen {seqlen} needs more than that",
            tokens.len()
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let start = rng.random_range(0..tokens.len() - seqlen);
            tokens[start..start + seqlen].to_vec()
        })
        .collect())
}
