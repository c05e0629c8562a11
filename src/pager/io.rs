//! Reading expert bytes from the model file: positioned reads that retry
//! interrupted and short reads and fail on anything else, through the page
//! cache or with `O_DIRECT`, a check that the file has not changed under the
//! reader, and injected faults for tests (`SDQ_FAULT_READ`, see
//! [`FaultPlan::parse`]).

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// File offsets, lengths and memory of `O_DIRECT` reads are multiples of this
/// (the largest logical block size in common use; page-aligned slots meet it).
pub const DIRECT_ALIGN: usize = 4096;

/// Opens `path` for reading with `O_DIRECT`: the disk writes straight into
/// the caller's buffer, bypassing the page cache. Fails where the file
/// system does not support it.
pub fn open_direct(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

/// One injected fault, on the first attempt of a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with an I/O error.
    Eio,
    /// The read is interrupted (must be retried).
    Eintr,
    /// The read returns half the bytes (the rest must be read again).
    Short,
    /// The read returns 0 bytes, as at the end of the file.
    Eof,
}

/// Faults to inject into the pager's reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// (1-based read number, fault).
    pub at: Vec<(u64, Fault)>,
    /// Added before every read.
    pub delay: Option<Duration>,
}

impl FaultPlan {
    /// Parses a comma-separated list: `eio@N`, `eintr@N`, `short@N`, `eof@N`
    /// (the N-th read, counted from 1), `delay=MS` (every read), or a bare `N`
    /// (`eio@N`).
    pub fn parse(text: &str) -> Result<FaultPlan, String> {
        let mut plan = FaultPlan::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if let Some(ms) = item.strip_prefix("delay=") {
                let ms: u64 = ms.parse().map_err(|_| format!("'{item}': delay=MS needs milliseconds"))?;
                plan.delay = Some(Duration::from_millis(ms));
                continue;
            }
            let (kind, n) = item.split_once('@').unwrap_or(("eio", item));
            let fault = match kind {
                "eio" => Fault::Eio,
                "eintr" => Fault::Eintr,
                "short" => Fault::Short,
                "eof" => Fault::Eof,
                _ => return Err(format!("'{item}': unknown fault '{kind}' (eio, eintr, short, eof, delay=MS)")),
            };
            let n: u64 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| format!("'{item}': '{n}' is not a read number (1, 2, ...)"))?;
            plan.at.push((n, fault));
        }
        Ok(plan)
    }

    fn fault_for(&self, read: u64) -> Option<Fault> {
        self.at.iter().find(|(n, _)| *n == read).map(|(_, f)| *f)
    }
}

/// What a model file looked like when the pager opened it: if its length or
/// modification time changes, bytes read from it may no longer be the bytes
/// the loader described (a file replaced by rename is harmless: the open
/// descriptor still reads the old one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    pub len: u64,
    pub modified: Option<SystemTime>,
}

impl FileStamp {
    pub fn of(file: &File) -> io::Result<FileStamp> {
        let m = file.metadata()?;
        Ok(FileStamp { len: m.len(), modified: m.modified().ok() })
    }

    /// An error if `file` no longer matches this stamp.
    pub fn check(&self, file: &File) -> io::Result<()> {
        let now = FileStamp::of(file)?;
        if now != *self {
            return Err(io::Error::other(format!(
                "the model file changed while it was in use (length {} -> {} bytes{}); its experts can no longer be trusted",
                self.len,
                now.len,
                if now.modified != self.modified { ", modified since it was opened" } else { "" }
            )));
        }
        Ok(())
    }
}

/// Reads ranges of model files into slots.
#[derive(Debug, Default)]
pub struct ExpertReader {
    faults: FaultPlan,
    reads: AtomicU64,
}

impl ExpertReader {
    pub fn new(faults: FaultPlan) -> ExpertReader {
        ExpertReader { faults, reads: AtomicU64::new(0) }
    }

    /// Fills `buf` from `file` at `offset`. EINTR and short reads are retried
    /// until every byte has arrived; end of file before that is an error.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_into(file, buf, offset, buf.len(), 1)?;
        // The slot now holds these bytes; a second copy in the page cache
        // would only push out pages that are needed (the mapped weights),
        // and under a limit that counts page cache, it is charged too.
        drop_cached(file, offset, buf.len() as u64);
        Ok(())
    }

    /// Reads `buf` from `file` (opened with `O_DIRECT`) at `offset`, both
    /// DIRECT_ALIGN-aligned, as `read_exact_at` does; the file may end after
    /// `need` bytes (the aligned superset of a range can run past the end).
    pub fn read_direct(&self, file: &File, buf: &mut [u8], offset: u64, need: usize) -> io::Result<()> {
        self.read_into(file, buf, offset, need, DIRECT_ALIGN)
    }

    /// Reads into `buf` until at least `need` bytes have arrived; a short read
    /// (injected ones included) keeps to multiples of `align`.
    fn read_into(&self, file: &File, buf: &mut [u8], offset: u64, need: usize, align: usize) -> io::Result<()> {
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(d) = self.faults.delay {
            std::thread::sleep(d);
        }
        let mut injected = self.faults.fault_for(n);
        let mut done = 0;
        while done < need {
            let got = match injected.take() {
                Some(Fault::Eio) => Err(io::Error::other(format!("injected read fault: EIO on read {n} (SDQ_FAULT_READ)"))),
                Some(Fault::Eintr) => Err(io::Error::from(io::ErrorKind::Interrupted)),
                Some(Fault::Short) => {
                    let half = ((buf.len() - done) / 2 / align * align).max(align).min(buf.len() - done);
                    file.read_at(&mut buf[done..done + half], offset + done as u64)
                }
                Some(Fault::Eof) => Ok(0),
                None => file.read_at(&mut buf[done..], offset + done as u64),
            };
            match got {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("file ended after {done} of {need} bytes at offset {offset}"),
                    ))
                }
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads issued so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

/// Turns kernel readahead off for the pager's own descriptor of `file`:
/// expert slices are read whole and at random, and readahead around each
/// (up to `read_ahead_kb`, 8 MiB on some disks) would read several times the
/// bytes asked for and fill the page cache with neighbours nobody uses.
/// llama.cpp's mapping of the same file keeps its own readahead.
pub fn advise_random(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: advice on a descriptor we hold open; it reads or writes no memory of ours.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
    }
}

/// Drops `len` bytes of `file` at `offset` from the page cache (best effort):
/// bytes kernel readahead brought in that the pager has no use for.
pub fn drop_cached(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: advice on a descriptor we hold open; it reads or writes no memory of ours.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, libc::POSIX_FADV_DONTNEED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn scratch_file(tag: &str) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("sdq-io-test-{tag}-{}", std::process::id()));
        std::fs::File::create(&path).unwrap().write_all(&(0..=255u8).collect::<Vec<_>>()).unwrap();
        let f = File::open(&path).unwrap();
        (path, f)
    }

    #[test]
    fn reads_exactly_or_fails() {
        let (path, f) = scratch_file("exact");
        let r = ExpertReader::new(FaultPlan::parse("3").unwrap());
        let mut buf = [0u8; 16];
        r.read_exact_at(&f, &mut buf, 16).unwrap();
        assert_eq!(buf[0], 16);
        let e = r.read_exact_at(&f, &mut buf, 250).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        let e = r.read_exact_at(&f, &mut buf, 0).unwrap_err();
        assert!(e.to_string().contains("injected read fault: EIO on read 3"), "{e}");
        r.read_exact_at(&f, &mut buf, 0).unwrap();
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn interrupted_and_short_reads_complete_and_early_eof_fails() {
        let (path, f) = scratch_file("faults");
        let r = ExpertReader::new(FaultPlan::parse("eintr@1, short@2, eof@3").unwrap());
        for start in [0u64, 100] {
            let mut buf = [0u8; 33];
            r.read_exact_at(&f, &mut buf, start).unwrap();
            assert!(buf.iter().enumerate().all(|(i, &b)| b as u64 == start + i as u64), "read {start}: {buf:?}");
        }
        let mut buf = [0u8; 8];
        let e = r.read_exact_at(&f, &mut buf, 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        assert_eq!(r.reads(), 3);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn fault_plans_parse_or_name_what_is_wrong() {
        let p = FaultPlan::parse("eio@4,delay=20, short@1").unwrap();
        assert_eq!(p.at, vec![(4, Fault::Eio), (1, Fault::Short)]);
        assert_eq!(p.delay, Some(Duration::from_millis(20)));
        assert_eq!(FaultPlan::parse("7").unwrap().at, vec![(7, Fault::Eio)]);
        for (bad, needle) in [("boom@3", "unknown fault 'boom'"), ("eio@0", "not a read number"), ("delay=x", "milliseconds")] {
            let e = FaultPlan::parse(bad).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn a_changed_file_is_noticed() {
        let (path, f) = scratch_file("stamp");
        let stamp = FileStamp::of(&f).unwrap();
        stamp.check(&f).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
        let e = stamp.check(&f).unwrap_err();
        assert!(e.to_string().contains("256 -> 100"), "{e}");
        std::fs::remove_file(path).unwrap();
    }
}
