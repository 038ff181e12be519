//! Host↔device traffic per quantized block, for report.json and `run --profile` (design.md §12: the GPU path
//! is device-resident by construction, and this is how a run shows it): bytes each way, host synchronizations
//! and launches of each block's window (its statistics, quantization, packed output, next-block forward, and
//! the prefetch of the next block's weights that overlaps it), against what residency allows — the block's
//! weights as uploaded plus its packed output. The resume state's saves (X, GiBs on a large model) are counted
//! apart.

use crate::ops::Traffic;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BlockTraffic {
    pub layer: usize,
    pub traffic: Traffic,
    /// The block's weights as uploaded plus its packed output as downloaded: what a device-resident block
    /// must move.
    pub floor_bytes: u64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TrafficReport {
    /// Who counted ("emulator", "host layer"; "" on a host backend, where nothing crosses).
    pub source: &'static str,
    /// Before the first block: the calibration windows' embedding (table upload, token ids).
    pub setup: Traffic,
    /// The blocks this process quantized (a resumed run lists only its own; none on a host backend).
    pub blocks: Vec<BlockTraffic>,
    /// The resume state's saves, all together (excluded from the blocks).
    pub resume_saves: Traffic,
}

fn mb(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl TrafficReport {
    /// `run --profile`'s table: one row per quantized block, then the setup and the saves.
    pub fn table(&self) -> String {
        if self.source.is_empty() {
            return String::new();
        }
        let mut s = format!(
            "host↔device traffic ({}): | block | MiB host→device | MiB device→host | ratio to the floor | syncs | launches |\n|---|---:|---:|---:|---:|---:|\n",
            self.source
        );
        for b in &self.blocks {
            let t = &b.traffic;
            let ratio = (t.htod_bytes + t.dtoh_bytes) as f64 / b.floor_bytes.max(1) as f64;
            s += &format!(
                "| {} | {:.1} | {:.1} | {:.3} | {} | {} |\n",
                b.layer,
                mb(t.htod_bytes),
                mb(t.dtoh_bytes),
                ratio,
                t.syncs,
                t.launches
            );
        }
        for (name, t) in [("setup", &self.setup), ("resume saves", &self.resume_saves)] {
            s += &format!(
                "| {name} | {:.1} | {:.1} | | {} | {} |\n",
                mb(t.htod_bytes),
                mb(t.dtoh_bytes),
                t.syncs,
                t.launches
            );
        }
        s += "floor: the block's weights as uploaded plus its packed output\n";
        s
    }
}
