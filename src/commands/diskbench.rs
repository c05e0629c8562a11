//! The disk under the model file, measured the way the pager reads it: reads
//! of one expert's size (0.5–2 MiB) at random offsets, from 1 to 32 at a time
//! (one thread per read in flight), buffered (with `POSIX_FADV_RANDOM`, and
//! the pages dropped after each read, as the pager does) or with `O_DIRECT`;
//! and one sequential stream for comparison. This is the ceiling the pager's
//! miss path is compared against (`scripts/bench-disk.py`).

use crate::engine::pager::io;
use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How the file is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Page cache, random access advice, pages dropped after each read.
    Buffered,
    /// `O_DIRECT`: 4 KiB-aligned offsets, lengths and buffers.
    Direct,
    /// One reader from a random start onwards, buffered with readahead.
    Sequential,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Buffered => "buffered",
            Mode::Direct => "direct",
            Mode::Sequential => "sequential",
        }
    }
}

const ALIGN: usize = 4096;

/// A buffer of `len` bytes starting on a 4 KiB boundary, inside a Vec (safe
/// code: the aligned window is found, not forced).
struct AlignedBuf {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let vec = vec![0u8; len + ALIGN];
        let start = vec.as_ptr().align_offset(ALIGN);
        AlignedBuf { vec, start, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

/// xorshift64*: offsets only need to be spread, not unpredictable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn open(path: &Path, mode: Mode) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if mode == Mode::Direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(path).map_err(|e| Error::io(format!("cannot open ({})", mode.name()), path, e))?;
    if mode == Mode::Buffered {
        io::advise_random(&f);
    }
    Ok(f)
}

/// One measurement: `depth` reads of `size` bytes in flight for `duration`.
pub fn measure(path: &Path, mode: Mode, size: usize, depth: usize, duration: Duration) -> Result<Value> {
    let len = std::fs::metadata(path).map_err(|e| Error::io("cannot stat", path, e))?.len();
    let size = size.next_multiple_of(ALIGN);
    if len < 2 * size as u64 {
        return Err(Error::invalid(format!("{} is too small ({len} bytes) for reads of {size} bytes", path.display())));
    }
    let span = (len - size as u64) / ALIGN as u64;
    let depth = if mode == Mode::Sequential { 1 } else { depth.max(1) };
    let bytes = AtomicU64::new(0);
    let reads = AtomicU64::new(0);
    let latency_us = std::sync::Mutex::new(Vec::new());
    let start = Instant::now();
    let deadline = start + duration;
    std::thread::scope(|s| -> Result<()> {
        let mut handles = Vec::new();
        for t in 0..depth {
            let (bytes, reads, latency_us) = (&bytes, &reads, &latency_us);
            handles.push(s.spawn(move || -> Result<()> {
                let f = open(path, mode)?;
                let mut buf = AlignedBuf::new(size);
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) << 32) ^ start.elapsed().as_nanos() as u64);
                let mut offset = rng.next() % span * ALIGN as u64;
                let mut lat = Vec::new();
                while Instant::now() < deadline {
                    if mode != Mode::Sequential || offset + size as u64 > len {
                        offset = rng.next() % span * ALIGN as u64;
                    }
                    let t0 = Instant::now();
                    f.read_exact_at(buf.as_mut(), offset).map_err(|e| Error::io(format!("reading {size} bytes at {offset} from"), path, e))?;
                    lat.push(t0.elapsed().as_micros() as u64);
                    if mode == Mode::Buffered {
                        io::drop_cached(&f, offset, size as u64);
                    }
                    if mode == Mode::Sequential {
                        offset += size as u64;
                    }
                    bytes.fetch_add(size as u64, Ordering::Relaxed);
                    reads.fetch_add(1, Ordering::Relaxed);
                }
                latency_us.lock().unwrap_or_else(|p| p.into_inner()).extend(lat);
                Ok(())
            }));
        }
        for h in handles {
            h.join().expect("reader thread")?;
        }
        Ok(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    let mut lat = latency_us.into_inner().unwrap_or_else(|p| p.into_inner());
    lat.sort_unstable();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0) as f64 / 1000.0;
    let total = bytes.load(Ordering::Relaxed);
    Ok(json!({
        "mode": mode.name(),
        "size_bytes": size,
        "depth": depth,
        "reads": reads.load(Ordering::Relaxed),
        "bytes": total,
        "seconds": secs,
        "mib_per_s": total as f64 / secs / (1 << 20) as f64,
        "latency_ms_p50": pct(0.5),
        "latency_ms_p99": pct(0.99),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_mode_from_a_small_file() {
        let dir = std::env::temp_dir().join(format!("sdq-diskbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("file");
        std::fs::write(&path, vec![7u8; 4 << 20]).unwrap();
        for mode in [Mode::Buffered, Mode::Sequential, Mode::Direct] {
            match measure(&path, mode, 512 << 10, 2, Duration::from_millis(50)) {
                Ok(r) => {
                    assert!(r["reads"].as_u64().unwrap() > 0, "{r}");
                    assert_eq!(r["bytes"].as_u64().unwrap(), r["reads"].as_u64().unwrap() * (512 << 10));
                }
                // tmpfs has no O_DIRECT.
                Err(e) if mode == Mode::Direct && e.to_string().contains("Invalid argument") => {}
                Err(e) => panic!("{mode:?}: {e}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
