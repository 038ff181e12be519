//! Progress reporting: an indicatif bar with ETA on a terminal, plain periodic lines otherwise (logs, CI),
//! nothing with `--quiet`/`--json`.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    Bar,
    Lines,
    Quiet,
}

impl Progress {
    /// Bars on a terminal, lines otherwise; `quiet` silences both.
    pub fn auto(quiet: bool) -> Progress {
        if quiet {
            Progress::Quiet
        } else if std::io::stderr().is_terminal() {
            Progress::Bar
        } else {
            Progress::Lines
        }
    }

    pub fn bar(&self, what: &str, total: u64, unit: &str) -> Bar {
        let pb = match self {
            Progress::Bar => {
                let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
                pb.set_style(
                    ProgressStyle::with_template(&format!(
                        "{what} [{{elapsed_precise}}] {{bar:40}} {{pos}}/{{len}} {unit} (ETA {{eta}}) {{msg}}"
                    ))
                    .expect("static template"),
                );
                Some(pb)
            }
            _ => None,
        };
        Bar {
            pb,
            lines: *self == Progress::Lines,
            what: what.into(),
            total,
            pos: 0,
            skipped: 0,
            start: Instant::now(),
            last: Instant::now(),
        }
    }

    pub fn line(&self, msg: &str) {
        if *self != Progress::Quiet {
            eprintln!("{msg}");
        }
    }
}

pub struct Bar {
    pb: Option<ProgressBar>,
    lines: bool,
    what: String,
    total: u64,
    pos: u64,
    /// Units done before this bar started (`skip`): in the position, not in the rate.
    skipped: u64,
    start: Instant,
    last: Instant,
}

impl Bar {
    pub fn inc(&mut self, n: u64) {
        self.pos += n;
        if let Some(pb) = &self.pb {
            pb.inc(n);
        } else if self.lines
            && (self.last.elapsed() > Duration::from_secs(10) || self.pos == self.total)
        {
            self.last = Instant::now();
            let el = self.start.elapsed().as_secs_f64();
            let eta = self.eta_secs(el);
            eprintln!(
                "{}: {}/{} ({el:.0} s elapsed, ETA {eta:.0} s)",
                self.what, self.pos, self.total
            );
        }
    }

    /// Counts `n` units done before this bar started (a resumed run's earlier blocks): they show in the
    /// position but not in the rate, or the ETA would credit this session with their time.
    pub fn skip(&mut self, n: u64) {
        self.pos += n;
        self.skipped += n;
        if let Some(pb) = &self.pb {
            pb.inc(n);
            pb.reset_eta();
        }
    }

    /// Seconds left at this session's rate, `elapsed` seconds after the bar started.
    fn eta_secs(&self, elapsed: f64) -> f64 {
        let done = self.pos - self.skipped;
        if done == 0 {
            return 0.0;
        }
        elapsed / done as f64 * self.total.saturating_sub(self.pos) as f64
    }

    pub fn set_message(&self, msg: String) {
        if let Some(pb) = &self.pb {
            pb.set_message(msg);
        }
    }

    pub fn finish(&self) {
        if let Some(pb) = &self.pb {
            pb.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_counts_only_this_sessions_units() {
        let mut bar = Progress::Quiet.bar("quantize", 30, "blocks");
        bar.skip(28);
        assert_eq!(bar.eta_secs(10.0), 0.0, "nothing done yet in this session");
        bar.inc(1);
        // One block in 10 s, one left: 10 s (not 10 / 29 s, as if the 28 earlier blocks took no time).
        assert!(
            (bar.eta_secs(10.0) - 10.0).abs() < 1e-9,
            "{}",
            bar.eta_secs(10.0)
        );
        bar.inc(1);
        assert_eq!(bar.eta_secs(20.0), 0.0);
    }
}
