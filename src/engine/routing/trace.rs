//! Routing traces: the CSV that `--sdq-trace` records and `sdq replay`
//! reads. One row per selected expert of each token:
//!
//! ```text
//! # sdq routing trace: top_k=8
//! # layer=0 bytes=1769472 experts=256 slot=1769472
//! # layer=1 bytes=2039808 experts=256 slot=2039808
//! step,phase,layer,expert,weight
//! 0,p,0,17,0.1834
//! ```
//!
//! Before the header, one comment line per paged layer gives its bytes per
//! expert (gate + up + down); `experts` (the layer's expert count) and
//! `slot` (the bytes of the arena slot the pager gives one, which direct
//! I/O's alignment can make larger) are sdq's additions, as is the `top_k`
//! line; a reader takes `slot` = `bytes` and the other two from the rows
//! where they are missing. `step` counts batches, a prompt batch (`p`) of
//! any size being one step and a decoded token (`d`) another; rows of the
//! same step and layer form one batch, and `weight` is the router's weight
//! for that token and expert.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub const HEADER: &str = "step,phase,layer,expert,weight";

/// Layer numbers and expert counts a trace may give: far beyond any model's
/// (the 35B-A3B has 40 layers of 256), and small enough that a replay's
/// tables by layer and expert stay small.
pub const MAX_LAYERS: u32 = 1 << 12;
pub const MAX_EXPERTS: u32 = 1 << 16;

/// Whether a batch is (part of) a prompt or one decoded token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Prompt,
    Decode,
}

impl Phase {
    /// A batch of one token is a decoded token; more is a prompt batch.
    pub fn of_tokens(n_tokens: usize) -> Phase {
        if n_tokens > 1 {
            Phase::Prompt
        } else {
            Phase::Decode
        }
    }

    fn letter(self) -> char {
        match self {
            Phase::Prompt => 'p',
            Phase::Decode => 'd',
        }
    }
}

/// One paged layer's line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceLayer {
    pub layer: u32,
    /// Bytes of one expert: gate + up + down.
    pub bytes: u64,
    /// Experts in the layer.
    pub experts: u32,
    /// Bytes of the arena slot for one expert before page rounding.
    pub slot: u64,
}

/// One batch: a layer's routing in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceBatch {
    pub step: u64,
    pub phase: Phase,
    pub layer: u32,
    /// The distinct experts selected, ascending.
    pub experts: Vec<u32>,
    /// Rows (token, expert selections) in the batch.
    pub rows: u32,
}

/// A whole trace, read back.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub top_k: usize,
    pub layers: BTreeMap<u32, TraceLayer>,
    pub batches: Vec<TraceBatch>,
}

impl Trace {
    /// Σ over layers of top-k × bytes per expert: what one token reads when
    /// the arena holds none of its experts.
    pub fn token_read_bytes(&self) -> u64 {
        self.layers.values().map(|l| self.top_k as u64 * l.bytes).sum()
    }

    /// Reads the trace at `path`.
    pub fn open(path: &Path) -> Result<Trace> {
        let f = File::open(path).map_err(|e| Error::io("cannot open trace", path, e))?;
        Trace::read(path, f)
    }

    /// Reads a trace from `r`; errors name `path` and the line.
    pub fn read(path: &Path, r: impl Read) -> Result<Trace> {
        let bad = |line: usize, msg: String| Error::format(path, line, msg);
        let mut top_k: Option<usize> = None;
        // layer → (bytes, experts, slot), as given
        let mut given: BTreeMap<u32, (u64, Option<u32>, Option<u64>)> = BTreeMap::new();
        let mut header_seen = false;
        let mut batches: Vec<TraceBatch> = Vec::new();
        let mut seen: std::collections::HashSet<(u64, u32)> = std::collections::HashSet::new();
        let mut max_expert: BTreeMap<u32, u32> = BTreeMap::new();
        let mut n = 0;
        for line in BufReader::new(r).lines() {
            n += 1;
            let line = line.map_err(|e| Error::io(format!("cannot read line {n} of trace"), path, e))?;
            let line = line.trim_end_matches('\r');
            if !header_seen {
                if let Some(comment) = line.strip_prefix('#') {
                    let fields = key_values(comment);
                    if let Some(v) = fields.get("top_k") {
                        top_k =
                            Some(number(v).filter(|&k| k > 0 && k <= 1 << 16).ok_or_else(|| bad(n, format!("top_k '{v}' is not a positive count")))? as usize);
                    }
                    if let Some(v) = fields.get("layer") {
                        let layer = number(v)
                            .filter(|&l| l < MAX_LAYERS as u64)
                            .ok_or_else(|| bad(n, format!("layer '{v}' is not a layer number below {MAX_LAYERS}")))? as u32;
                        let field = |k: &str| {
                            fields
                                .get(k)
                                .map(|v| number(v).filter(|&x| x > 0).ok_or_else(|| bad(n, format!("{k} '{v}' of layer {layer} is not a positive number"))))
                        };
                        let bytes = field("bytes").ok_or_else(|| bad(n, format!("layer {layer} has no bytes=")))??;
                        let experts = field("experts")
                            .transpose()?
                            .map(|e| {
                                if e <= MAX_EXPERTS as u64 {
                                    Ok(e as u32)
                                } else {
                                    Err(bad(n, format!("layer {layer}: {e} experts is more than {MAX_EXPERTS}")))
                                }
                            })
                            .transpose()?;
                        let slot = field("slot").transpose()?;
                        if bytes > 1 << 40 || slot.is_some_and(|s| s < bytes || s > 1 << 40) {
                            return Err(bad(n, format!("layer {layer}: bytes {bytes} / slot {slot:?} are out of range")));
                        }
                        if given.insert(layer, (bytes, experts, slot)).is_some() {
                            return Err(bad(n, format!("layer {layer} is listed twice")));
                        }
                    }
                    continue;
                }
                if line.trim() != HEADER {
                    return Err(bad(n, format!("expected the header '{HEADER}' after the comment lines, found '{}'", clip(line))));
                }
                if given.is_empty() {
                    return Err(bad(n, "no '# layer=L bytes=B' line before the header".into()));
                }
                header_seen = true;
                continue;
            }
            if line.trim().is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            let [step, phase, layer, expert, weight] = f[..] else {
                return Err(bad(n, format!("expected 5 fields (step,phase,layer,expert,weight), found {} in '{}'", f.len(), clip(line))));
            };
            let step = number(step).ok_or_else(|| bad(n, format!("step '{step}' is not a number")))?;
            let phase = match phase {
                "p" => Phase::Prompt,
                "d" => Phase::Decode,
                _ => return Err(bad(n, format!("phase '{phase}' is not p or d"))),
            };
            let layer = number(layer)
                .and_then(|l| u32::try_from(l).ok())
                .filter(|l| given.contains_key(l))
                .ok_or_else(|| bad(n, format!("layer '{layer}' has no '# layer=' line")))?;
            let expert = number(expert)
                .filter(|&e| e < MAX_EXPERTS as u64)
                .ok_or_else(|| bad(n, format!("expert '{expert}' is not an expert number below {MAX_EXPERTS}")))? as u32;
            if let Some(limit) = given[&layer].1 {
                if expert >= limit {
                    return Err(bad(n, format!("expert {expert} of layer {layer} is out of range ({limit} experts)")));
                }
            }
            match weight.parse::<f32>() {
                Ok(w) if w.is_finite() => {}
                _ => return Err(bad(n, format!("weight '{weight}' is not a finite number"))),
            }
            let m = max_expert.entry(layer).or_insert(0);
            *m = (*m).max(expert);
            match batches.last_mut() {
                Some(b) if b.step == step && b.layer == layer => {
                    if b.phase != phase {
                        return Err(bad(n, format!("step {step} is both p and d")));
                    }
                    if let Err(i) = b.experts.binary_search(&expert) {
                        b.experts.insert(i, expert);
                    }
                    b.rows += 1;
                }
                last => {
                    if let Some(b) = last {
                        if step < b.step {
                            return Err(bad(n, format!("step {step} comes after step {}", b.step)));
                        }
                        if step == b.step && b.phase != phase {
                            return Err(bad(n, format!("step {step} is both p and d")));
                        }
                    }
                    if !seen.insert((step, layer)) {
                        return Err(bad(n, format!("rows of step {step}, layer {layer} are not together")));
                    }
                    batches.push(TraceBatch { step, phase, layer, experts: vec![expert], rows: 1 });
                }
            }
        }
        if !header_seen {
            return Err(bad(n, format!("no header '{HEADER}'")));
        }
        if batches.is_empty() {
            return Err(bad(n, "the trace has no rows".into()));
        }
        let top_k = match top_k {
            Some(k) => k,
            // A decoded token's batch has one row per selected expert.
            None => batches
                .iter()
                .filter(|b| b.phase == Phase::Decode)
                .map(|b| b.rows as usize)
                .max()
                .ok_or_else(|| bad(n, "no 'top_k=' comment and no decoded token to tell the router's top-k from".into()))?,
        };
        let layers = given
            .into_iter()
            .map(|(layer, (bytes, experts, slot))| {
                let experts = experts.unwrap_or_else(|| max_expert.get(&layer).map_or(1, |&m| m + 1));
                (layer, TraceLayer { layer, bytes, experts, slot: slot.unwrap_or(bytes) })
            })
            .collect();
        Ok(Trace { top_k, layers, batches })
    }
}

/// `key=value` pairs of a comment line (other words are ignored); hot sets'
/// comment lines are read the same way.
pub(crate) fn key_values(comment: &str) -> BTreeMap<&str, &str> {
    comment.split_whitespace().filter_map(|w| w.split_once('=')).collect()
}

fn number(s: &str) -> Option<u64> {
    s.trim().parse::<u64>().ok()
}

/// A line as an error message quotes it.
fn clip(line: &str) -> String {
    let mut s: String = line.chars().take(60).collect();
    if s.len() < line.len() {
        s.push('…');
    }
    s
}

/// Records a live run's routing to a trace file.
pub struct Recorder {
    path: PathBuf,
    out: BufWriter<File>,
    /// Set once the comment lines and the header are written.
    started: bool,
    /// The open step and its phase, which its first layer decides.
    step: Option<(u64, Phase)>,
}

impl Recorder {
    /// Creates (or truncates) the trace file at `path`.
    pub fn create(path: &Path) -> Result<Recorder> {
        let f = File::create(path).map_err(|e| Error::io("cannot create trace file", path, e))?;
        Ok(Recorder { path: path.to_path_buf(), out: BufWriter::with_capacity(1 << 20, f), started: false, step: None })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the comment lines and the header, once: `layers` are (layer,
    /// bytes per expert, experts, slot bytes).
    pub fn start(&mut self, top_k: usize, layers: impl IntoIterator<Item = (u32, u64, u32, u64)>) -> Result<()> {
        if self.started {
            return Ok(());
        }
        self.started = true;
        let mut text = format!("# sdq routing trace: top_k={top_k}\n");
        for (layer, bytes, experts, slot) in layers {
            text += &format!("# layer={layer} bytes={bytes} experts={experts} slot={slot}\n");
        }
        text += HEADER;
        text.push('\n');
        self.write(text.as_bytes())
    }

    /// Records one layer's routing of one batch: `first_layer` is true for
    /// the first paged layer of a batch, which starts a new step. `rows`
    /// are (expert, weight) in token order.
    pub fn record(&mut self, first_layer: bool, phase: Phase, layer: u32, rows: impl IntoIterator<Item = (u32, f32)>) -> Result<()> {
        // A prompt's last layer may see its output rows alone (llama.cpp
        // drops the others before that layer's FFN): the step keeps the
        // phase its first layer had.
        let (step, phase) = match (self.step, first_layer) {
            (None, _) => (0, phase),
            (Some((s, _)), true) => (s + 1, phase),
            (Some((s, p)), false) => (s, p),
        };
        if first_layer && self.step.is_some() {
            // The last step is complete: a run cut short keeps every whole step.
            self.flush()?;
        }
        self.step = Some((step, phase));
        let p = phase.letter();
        let mut text = String::new();
        for (expert, weight) in rows {
            text += &format!("{step},{p},{layer},{expert},{weight}\n");
        }
        self.write(text.as_bytes())
    }

    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io("cannot write trace file", &self.path, e))
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(|e| Error::io("cannot write trace file", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Trace> {
        Trace::read(Path::new("t.csv"), text.as_bytes())
    }

    #[test]
    fn recorded_traces_read_back() {
        let dir = std::env::temp_dir().join(format!("sdq-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        let mut r = Recorder::create(&path).unwrap();
        r.start(2, [(0, 1000, 4, 4096), (1, 2000, 4, 2000)]).unwrap();
        // A prompt batch of two tokens, then one decoded token.
        r.record(true, Phase::Prompt, 0, [(1, 0.6), (2, 0.4), (1, 0.5), (3, 0.5)]).unwrap();
        r.record(false, Phase::Prompt, 1, [(0, 0.7), (1, 0.3), (0, 0.9), (1, 0.1)]).unwrap();
        r.record(true, Phase::Decode, 0, [(3, 0.5), (0, 0.5)]).unwrap();
        r.record(false, Phase::Decode, 1, [(2, 0.75), (3, 0.25)]).unwrap();
        // A prompt whose last layer saw only its output row stays a prompt step.
        r.record(true, Phase::Prompt, 0, [(1, 0.5), (2, 0.5), (0, 0.5), (3, 0.5)]).unwrap();
        r.record(false, Phase::Decode, 1, [(2, 0.75), (3, 0.25)]).unwrap();
        r.flush().unwrap();
        let t = Trace::open(&path).unwrap();
        assert_eq!(t.top_k, 2);
        assert_eq!(t.layers[&0], TraceLayer { layer: 0, bytes: 1000, experts: 4, slot: 4096 });
        assert_eq!(t.token_read_bytes(), 2 * 3000);
        let b: Vec<_> = t.batches.iter().map(|b| (b.step, b.phase, b.layer, b.experts.clone(), b.rows)).collect();
        assert_eq!(
            b,
            vec![
                (0, Phase::Prompt, 0, vec![1, 2, 3], 4),
                (0, Phase::Prompt, 1, vec![0, 1], 4),
                (1, Phase::Decode, 0, vec![0, 3], 2),
                (1, Phase::Decode, 1, vec![2, 3], 2),
                (2, Phase::Prompt, 0, vec![0, 1, 2, 3], 4),
                (2, Phase::Prompt, 1, vec![2, 3], 2)
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_plain_format_reads_with_defaults() {
        let t = read("# layer=3 bytes=100\nstep,phase,layer,expert,weight\n0,d,3,5,1\n0,d,3,7,0.5\n").unwrap();
        assert_eq!(t.top_k, 2, "from the decoded token");
        assert_eq!(t.layers[&3], TraceLayer { layer: 3, bytes: 100, experts: 8, slot: 100 });
    }

    #[test]
    fn bad_traces_name_the_line_and_value() {
        let head = "# layer=0 bytes=10 experts=4\nstep,phase,layer,expert,weight\n";
        for (text, needle) in [
            ("", "t.csv:0: no header"),
            ("step,phase,layer,expert,weight\n0,d,0,1,1\n", "t.csv:1: no '# layer=L bytes=B' line"),
            ("# layer=0\nstep,phase,layer,expert,weight\n", "t.csv:1: layer 0 has no bytes="),
            ("# layer=0 bytes=-5\n", "bytes '-5' of layer 0"),
            ("# layer=0 bytes=1\n# layer=0 bytes=2\n", ":2: layer 0 is listed twice"),
            ("# layer=99999 bytes=1\n", ":1: layer '99999' is not a layer number below 4096"),
            ("# layer=1 bytes=1 experts=100000\n", ":1: layer 1: 100000 experts is more than 65536"),
            ("# layer=0 bytes=1\nstep,layer\n", ":2: expected the header"),
            (head, ":2: the trace has no rows"),
            (&format!("{head}0,d,0,1\n"), ":3: expected 5 fields"),
            (&format!("{head}x,d,0,1,1\n"), ":3: step 'x'"),
            (&format!("{head}0,q,0,1,1\n"), ":3: phase 'q'"),
            (&format!("{head}0,d,9,1,1\n"), ":3: layer '9' has no '# layer=' line"),
            (&format!("{head}0,d,0,4,1\n"), ":3: expert 4 of layer 0 is out of range (4 experts)"),
            (&format!("{head}0,d,0,1,nan\n"), ":3: weight 'nan'"),
            (&format!("{head}1,d,0,1,1\n0,d,0,1,1\n"), ":4: step 0 comes after step 1"),
            (&format!("{head}0,d,0,1,1\n0,p,0,2,1\n"), ":4: step 0 is both p and d"),
            (
                "# layer=0 bytes=10 experts=4\n# layer=1 bytes=10\nstep,phase,layer,expert,weight\n0,d,0,1,1\n0,d,1,1,1\n0,d,0,2,1\n",
                ":6: rows of step 0, layer 0 are not together",
            ),
            ("# layer=0 bytes=10\nstep,phase,layer,expert,weight\n0,p,0,1,1\n", "no decoded token to tell the router's top-k from"),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }
}
