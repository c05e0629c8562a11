//! Hot sets: what the arena held at exit, and what the eviction policy had
//! learned, saved by `--sdq-hotset FILE` so the next run starts warm.
//!
//! ```text
//! # sdq hot set
//! # layer=0 bytes=1769472 experts=256
//! layer,expert,count,held
//! 0,17,12.25,1
//! 0,40,0.5,0
//! ```
//!
//! The `# layer=` lines give the model's geometry, so a hot set is only
//! used with a model that has the same; one row per expert the policy has a
//! use count for (`count`, 0 for a policy that keeps none) or that was held
//! (`held` 1) at exit.

use crate::engine::pager::ExpertKey;
use crate::engine::routing::trace::{MAX_EXPERTS, MAX_LAYERS};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

pub const HEADER: &str = "layer,expert,count,held";

/// One expert's line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HotExpert {
    pub key: ExpertKey,
    /// The policy's use count at exit (0 if it keeps none).
    pub count: f64,
    /// In the arena at exit.
    pub held: bool,
}

/// A hot set: the geometry it was saved for, and its experts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HotSet {
    /// layer → (bytes per expert, experts)
    pub layers: BTreeMap<u32, (u64, u32)>,
    pub experts: Vec<HotExpert>,
}

impl HotSet {
    /// Reads the hot set at `path`; None if there is no such file (a first run).
    pub fn open(path: &Path) -> Result<Option<HotSet>> {
        match std::fs::File::open(path) {
            Ok(f) => HotSet::read(path, f).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot open hot set", path, e)),
        }
    }

    /// Reads a hot set from `r`; errors name `path` and the line.
    pub fn read(path: &Path, r: impl Read) -> Result<HotSet> {
        let bad = |line: usize, msg: String| Error::format(path, line, msg);
        let mut set = HotSet::default();
        let mut header = false;
        let mut seen = std::collections::HashSet::new();
        let mut n = 0;
        for line in BufReader::new(r).lines() {
            n += 1;
            let line = line.map_err(|e| Error::io(format!("cannot read line {n} of hot set"), path, e))?;
            let line = line.trim_end_matches('\r');
            if !header {
                if let Some(comment) = line.strip_prefix('#') {
                    let kv = crate::engine::routing::trace::key_values(comment);
                    if let Some(v) = kv.get("layer") {
                        let num = |k: &str, max: u64| -> Result<u64> {
                            let v = kv.get(k).ok_or_else(|| bad(n, format!("layer line without {k}=")))?;
                            v.parse::<u64>().ok().filter(|&x| x > 0 && x <= max).ok_or_else(|| bad(n, format!("{k} '{v}' is not a number from 1 to {max}")))
                        };
                        let layer = v
                            .parse::<u32>()
                            .ok()
                            .filter(|&l| l < MAX_LAYERS)
                            .ok_or_else(|| bad(n, format!("layer '{v}' is not a layer number below {MAX_LAYERS}")))?;
                        let (bytes, experts) = (num("bytes", 1 << 40)?, num("experts", MAX_EXPERTS as u64)? as u32);
                        if set.layers.insert(layer, (bytes, experts)).is_some() {
                            return Err(bad(n, format!("layer {layer} is listed twice")));
                        }
                    }
                    continue;
                }
                if line.trim() != HEADER {
                    return Err(bad(n, format!("expected the header '{HEADER}' after the comment lines")));
                }
                if set.layers.is_empty() {
                    return Err(bad(n, "no '# layer=L bytes=B experts=N' line before the header".into()));
                }
                header = true;
                continue;
            }
            if line.trim().is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            let [layer, expert, count, held] = f[..] else {
                return Err(bad(n, format!("expected 4 fields ({HEADER}), found {}", f.len())));
            };
            let layer: u32 =
                layer.parse().ok().filter(|l| set.layers.contains_key(l)).ok_or_else(|| bad(n, format!("layer '{layer}' has no '# layer=' line")))?;
            let limit = set.layers[&layer].1;
            let expert: u32 = expert
                .parse()
                .ok()
                .filter(|&e| e < limit)
                .ok_or_else(|| bad(n, format!("expert '{expert}' of layer {layer} is not below its {limit} experts")))?;
            let count: f64 = count
                .parse()
                .ok()
                .filter(|c: &f64| c.is_finite() && *c >= 0.0 && *c < 1e12)
                .ok_or_else(|| bad(n, format!("count '{count}' is not a finite number ≥ 0")))?;
            let held = match held {
                "1" => true,
                "0" => false,
                _ => return Err(bad(n, format!("held '{held}' is not 0 or 1"))),
            };
            if !seen.insert((layer, expert)) {
                return Err(bad(n, format!("expert {expert} of layer {layer} is listed twice")));
            }
            set.experts.push(HotExpert { key: ExpertKey::new(layer, expert), count, held });
        }
        if !header {
            return Err(bad(n.max(1), format!("no header '{HEADER}'")));
        }
        Ok(set)
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut s = String::from("# sdq hot set\n");
        for (l, (bytes, experts)) in &self.layers {
            s += &format!("# layer={l} bytes={bytes} experts={experts}\n");
        }
        s += HEADER;
        s.push('\n');
        for e in &self.experts {
            s += &format!("{},{},{},{}\n", e.key.layer, e.key.expert, e.count, u8::from(e.held));
        }
        s
    }

    /// Writes the hot set to `path` whole (a temporary file, then a rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::files::write_whole(path, &self.to_text()).map_err(|e| Error::io("cannot write hot set", path, e))
    }

    /// Checks that this hot set was saved for a model of geometry `layers`
    /// (layer → bytes per expert, experts); the error names what differs.
    pub fn check_model(&self, path: &Path, layers: &BTreeMap<u32, (u64, u32)>) -> Result<()> {
        if &self.layers == layers {
            return Ok(());
        }
        let differs = layers
            .iter()
            .find(|(l, g)| self.layers.get(l) != Some(g))
            .map(|(l, (b, e))| match self.layers.get(l) {
                Some((hb, he)) => format!("layer {l} has {he} experts of {hb} bytes there and {e} of {b} bytes in this model"),
                None => format!("it has no layer {l}"),
            })
            .unwrap_or_else(|| format!("it has {} paged layers and this model {}", self.layers.len(), layers.len()));
        Err(Error::invalid(format!("hot set {} was saved for another model: {differs}; remove it, or pass another --sdq-hotset file", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<HotSet> {
        HotSet::read(Path::new("h.txt"), text.as_bytes())
    }

    #[test]
    fn saved_hot_sets_read_back() {
        let set = HotSet {
            layers: [(0, (100, 8)), (2, (200, 8))].into_iter().collect(),
            experts: vec![HotExpert { key: ExpertKey::new(0, 3), count: 2.5, held: true }, HotExpert { key: ExpertKey::new(2, 7), count: 0.125, held: false }],
        };
        assert_eq!(read(&set.to_text()).unwrap(), set);
        let dir = std::env::temp_dir().join(format!("sdq-hot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hot.txt");
        assert_eq!(HotSet::open(&path).unwrap(), None, "no file: a first run");
        set.save(&path).unwrap();
        assert_eq!(HotSet::open(&path).unwrap(), Some(set.clone()));
        assert!(set.check_model(&path, &set.layers).is_ok());
        let other = [(0, (100, 8)), (2, (300, 8))].into_iter().collect();
        let e = set.check_model(&path, &other).unwrap_err().to_string();
        assert!(e.contains("another model: layer 2 has 8 experts of 200 bytes there and 8 of 300 bytes in this model"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_hot_sets_name_the_line_and_value() {
        let head = "# layer=0 bytes=10 experts=4\nlayer,expert,count,held\n";
        for (text, needle) in [
            ("", "h.txt:1: no header"),
            ("layer,expert,count,held\n", ":1: no '# layer=L bytes=B experts=N' line"),
            ("# layer=0 bytes=10\n", ":1: layer line without experts="),
            ("# layer=0 bytes=0 experts=4\n", ":1: bytes '0' is not a number"),
            (&format!("{head}0,1,1\n"), ":3: expected 4 fields"),
            (&format!("{head}1,1,1,1\n"), ":3: layer '1' has no '# layer=' line"),
            (&format!("{head}0,4,1,1\n"), ":3: expert '4' of layer 0 is not below its 4 experts"),
            (&format!("{head}0,1,-1,1\n"), ":3: count '-1'"),
            (&format!("{head}0,1,inf,1\n"), ":3: count 'inf'"),
            (&format!("{head}0,1,1,yes\n"), ":3: held 'yes'"),
            (&format!("{head}0,1,1,1\n0,1,2,0\n"), ":4: expert 1 of layer 0 is listed twice"),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }
}
