//! report.json: options, per-layer errors, per-phase timings, peak memory, versions.

use super::options::RunOptions;
use super::quantize_block::LinearReport;

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Timings {
    pub calibration_data: f64,
    /// Waiting for a block's weights (read from disk and converted to f32 by the prefetch thread while the
    /// previous block works; only what did not overlap counts).
    #[serde(default)]
    pub load: f64,
    pub forward: f64,
    pub statistics: f64,
    /// Of `statistics`, V's per-head attention-weighted H_col (BoA).
    #[serde(default)]
    pub v_col: f64,
    /// All of quantization, and its parts: factorizations (damping + U = chol(H⁻¹)ᵀ), static scale
    /// search, sweeps (including dynamic group searches). The rest is the before/after error report.
    pub quantize: f64,
    pub factor: f64,
    pub search: f64,
    pub sweep: f64,
    /// `--alloc-proxy output`'s GPTQ runs and block forwards (pipeline/sensitivity.rs).
    #[serde(default)]
    pub alloc_proxy: f64,
    /// Waiting for shard writes (they run on a writer thread while the next block works) and the resume
    /// state's saves.
    pub write: f64,
    pub total: f64,
    /// Wall seconds of each block this run quantized (`--layers`), in order, without its wait for the weights
    /// (the first block's disk read) or the resume-state save: what a projection to a deeper model of the
    /// same shape multiplies.
    #[serde(default)]
    pub blocks: Vec<f64>,
}

impl Timings {
    /// Every phase with its seconds and share of the total; "other" is what no phase timer covered.
    pub fn phases(&self) -> Vec<(&'static str, f64)> {
        let report = (self.quantize - self.factor - self.search - self.sweep).max(0.0);
        let mut rows = vec![
            ("calibration data", self.calibration_data),
            ("weights load (not overlapped)", self.load),
            ("forward", self.forward),
            (
                "statistics (XᵀX, head covariances)",
                self.statistics - self.v_col,
            ),
            ("statistics: V's per-head H_col", self.v_col),
            ("factorization (damping + Cholesky)", self.factor),
            ("scale search", self.search),
            ("sweep", self.sweep),
            ("error report", report),
            ("allocation proxy (--alloc-proxy output)", self.alloc_proxy),
            ("write (not overlapped)", self.write),
        ];
        let covered: f64 = rows.iter().map(|r| r.1).sum();
        rows.push(("other", (self.total - covered).max(0.0)));
        rows
    }

    /// `run --profile`'s table.
    pub fn phase_table(&self) -> String {
        let total = self.total.max(f64::MIN_POSITIVE);
        let mut s = String::from("| phase | seconds | share |\n|---|---:|---:|\n");
        for (name, secs) in self.phases() {
            s += &format!("| {name} | {secs:.2} | {:.1}% |\n", 100.0 * secs / total);
        }
        s += &format!("| total | {:.2} | 100.0% |\n", self.total);
        if let Some(b) = self.block_summary() {
            s += &b;
            s.push('\n');
        }
        s
    }

    /// "blocks: N, first F s, median of the rest M s" (weight waits and saves excluded); None for < 2 blocks.
    pub fn block_summary(&self) -> Option<String> {
        let (first, rest) = self.blocks.split_first()?;
        if rest.is_empty() {
            return None;
        }
        let mut r = rest.to_vec();
        r.sort_by(f64::total_cmp);
        Some(format!(
            "blocks: {}, first {first:.2} s, median of the rest {:.2} s (weight waits and resume saves excluded)",
            self.blocks.len(),
            r[r.len() / 2]
        ))
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerReport {
    pub layer: usize,
    pub linears: Vec<LinearReport>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RunReport {
    pub version: &'static str,
    pub options: RunOptions,
    pub device: String,
    pub calibration_tokens: usize,
    pub layers: Vec<LayerReport>,
    pub seconds: Timings,
    /// Peak resident memory of the process (VmHWM), bytes.
    pub peak_rss_bytes: Option<u64>,
    /// Host↔device traffic per quantized block (traffic.rs; empty on the CPU).
    pub traffic: super::traffic::TrafficReport,
    /// The weights of a quantized block that are copied through in full precision although they are linear
    /// maps (names under `model.layers.{l}.`): an MoE block's router and shared-expert gate.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub full_precision: Vec<String>,
}

impl RunReport {
    pub fn new(
        options: &RunOptions,
        device: String,
        layers: Vec<LayerReport>,
        seconds: Timings,
        calibration_tokens: usize,
    ) -> RunReport {
        RunReport {
            version: env!("CARGO_PKG_VERSION"),
            options: options.clone(),
            device,
            calibration_tokens,
            layers,
            seconds,
            peak_rss_bytes: peak_rss_bytes(),
            traffic: Default::default(),
            full_precision: Vec::new(),
        }
    }

    /// Mean relative error over all quantized linears that have one: (RTN min-max, method). An expert's
    /// down_proj with too few routed tokens has no statistic, so no error; (NaN, NaN) when none has one.
    pub fn mean_errors(&self) -> (f64, f64) {
        let all: Vec<&LinearReport> = self
            .layers
            .iter()
            .flat_map(|l| &l.linears)
            .filter(|r| r.error.is_finite())
            .collect();
        if all.is_empty() {
            // RTN without calibration measures no error; NaN tells the caller there is none to print.
            return (f64::NAN, f64::NAN);
        }
        let n = all.len() as f64;
        (
            all.iter().map(|r| r.rtn_error).sum::<f64>() / n,
            all.iter().map(|r| r.error).sum::<f64>() / n,
        )
    }
}

/// VmHWM from /proc/self/status (Linux); None elsewhere.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kb_field("/proc/self/status", "VmHWM:")
}

/// The `KEY: N kB` line of a /proc file, in bytes (Linux); None elsewhere.
pub(crate) fn proc_kb_field(path: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_summary_separates_the_first_block() {
        let mut t = Timings::default();
        assert_eq!(t.block_summary(), None);
        t.blocks = vec![9.0];
        assert_eq!(t.block_summary(), None, "one block has no rest");
        t.blocks = vec![9.0, 3.0, 2.0, 4.0];
        let s = t.block_summary().unwrap();
        assert!(
            s.starts_with("blocks: 4, first 9.00 s, median of the rest 3.00 s"),
            "{s}"
        );
        assert!(t.phase_table().ends_with(&format!("{s}\n")));
    }
}
