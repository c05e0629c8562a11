//! Reading expert bytes from the model file: positioned reads that retry
//! interrupted and short reads at once and transient errors (EIO, EAGAIN,
//! an early end of file) a bounded number of times with backoff
//! ([`RetryPolicy`]), through the page cache or with `O_DIRECT`, a check that
//! the file has not changed under the reader, and injected faults for tests
//! (`SDQ_FAULT_READ`, see [`FaultPlan::parse`]).

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

/// One injected fault.
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
    /// The reading code panics (sdq's own bug, as a host program would
    /// meet it): the read fails with the panic's message.
    Panic,
}

/// One planned fault: which reads, which fault, how many tries of each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedFault {
    /// The 1-based read number.
    pub read: u64,
    /// Every read from `read` on (a disk that has failed), not just that one.
    pub onward: bool,
    pub fault: Fault,
    /// Tries of each read it fails (None: every one).
    pub times: Option<u32>,
}

/// Faults to inject into the pager's reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub at: Vec<PlannedFault>,
    /// Added before every read.
    pub delay: Option<Duration>,
    /// Every try of every read fails with EIO while this file exists (a
    /// fault a test switches on and off in a running process).
    pub eio_while: Option<std::path::PathBuf>,
    /// The numbered faults (`at`) hold only while this file exists: a test
    /// fails reads from N on inside one request, then ends the fault before
    /// the next, however many reads the failed request issued.
    pub at_while: Option<std::path::PathBuf>,
}

impl FaultPlan {
    /// Parses a comma-separated list: `eio@N`, `eintr@N`, `short@N`, `eof@N`
    /// (the N-th read, counted from 1), `panic@N` (the reading code panics on
    /// read N), `delay=MS` (every read), or a bare `N`
    /// (`eio@N`). `eio` and `eof` fail every attempt of read N (a fault that
    /// stays); `eio@N*K` and `eof@N*K` fail its first K attempts only (a
    /// transient fault the retries get past); `eio@N+` fails every read from
    /// N on (a disk that has died); `eio-while=PATH` fails every read while
    /// PATH exists; `while=PATH` lets the numbered faults hit only while PATH
    /// exists. `eintr` and `short` hit the first attempt once.
    pub fn parse(text: &str) -> Result<FaultPlan, String> {
        let mut plan = FaultPlan::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if let Some(path) = item.strip_prefix("eio-while=") {
                if path.is_empty() {
                    return Err(format!("'{item}': eio-while=PATH needs a path"));
                }
                plan.eio_while = Some(path.into());
                continue;
            }
            if let Some(path) = item.strip_prefix("while=") {
                if path.is_empty() {
                    return Err(format!("'{item}': while=PATH needs a path"));
                }
                plan.at_while = Some(path.into());
                continue;
            }
            if let Some(ms) = item.strip_prefix("delay=") {
                let ms: u64 = ms.parse().map_err(|_| format!("'{item}': delay=MS needs milliseconds"))?;
                plan.delay = Some(Duration::from_millis(ms));
                continue;
            }
            let (kind, at) = item.split_once('@').unwrap_or(("eio", item));
            let fault = match kind {
                "eio" => Fault::Eio,
                "eintr" => Fault::Eintr,
                "short" => Fault::Short,
                "eof" => Fault::Eof,
                "panic" => Fault::Panic,
                _ => return Err(format!("'{item}': unknown fault '{kind}' (eio, eintr, short, eof, panic, delay=MS)")),
            };
            let persistent = matches!(fault, Fault::Eio | Fault::Eof);
            let (at, onward) = match at.strip_suffix('+') {
                Some(n) if persistent => (n, true),
                Some(_) => return Err(format!("'{item}': only eio and eof take N+ (every read from N on)")),
                None => (at, false),
            };
            let (n, times) = match at.split_once('*') {
                Some((n, k)) if persistent => {
                    let k: u32 = k.parse().ok().filter(|&k| k > 0).ok_or_else(|| format!("'{item}': '{k}' is not a number of attempts (1, 2, ...)"))?;
                    (n, Some(k))
                }
                Some(_) => return Err(format!("'{item}': only eio and eof take *K (attempts)")),
                None => (at, None),
            };
            let n: u64 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| format!("'{item}': '{n}' is not a read number (1, 2, ...)"))?;
            plan.at.push(PlannedFault { read: n, onward, fault, times });
        }
        Ok(plan)
    }

    /// The fault injected into attempt `attempt` (from 0) of read `read`.
    fn fault_for(&self, read: u64, attempt: u32) -> Option<Fault> {
        if self.eio_while.as_ref().is_some_and(|p| p.exists()) {
            return Some(Fault::Eio);
        }
        if self.at_while.as_ref().is_some_and(|p| !p.exists()) {
            return None;
        }
        let &PlannedFault { fault, times, .. } = self.at.iter().find(|p| p.read == read || p.onward && read >= p.read)?;
        let hits = match fault {
            Fault::Eintr | Fault::Short | Fault::Panic => attempt == 0,
            Fault::Eio | Fault::Eof => times.map_or(true, |k| attempt < k),
        };
        hits.then_some(fault)
    }
}

/// How often a read that failed with a transient error is tried again, and
/// how long to wait first (doubling each time): by default 3 more tries
/// within 0.7 s (`SDQ_READ_RETRIES`, `SDQ_READ_BACKOFF_MS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub retries: u32,
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy { retries: 3, backoff: Duration::from_millis(100) }
    }
}

/// An error another try may get past: the disk's EIO (a bad sector can be
/// reread; a network or virtual disk's hiccup passes), EAGAIN, a timeout,
/// or the file ending early (a short read that stayed short).
fn is_transient(e: &io::Error) -> bool {
    const TRANSIENT: [i32; 4] = [libc::EIO, libc::EAGAIN, libc::ETIMEDOUT, libc::EBUSY];
    e.raw_os_error().is_some_and(|c| TRANSIENT.contains(&c))
        || matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
        || e.get_ref().is_some_and(|inner| inner.is::<InjectedEio>())
}

/// The error an injected `eio` fault gives.
#[derive(Debug)]
struct InjectedEio(u64);

impl std::fmt::Display for InjectedEio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected read fault: EIO on read {} (SDQ_FAULT_READ)", self.0)
    }
}

impl std::error::Error for InjectedEio {}

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
    retry: RetryPolicy,
    reads: AtomicU64,
    retried: AtomicU64,
}

impl ExpertReader {
    pub fn new(faults: FaultPlan) -> ExpertReader {
        ExpertReader { faults, ..Default::default() }
    }

    pub fn with_retries(mut self, retry: RetryPolicy) -> ExpertReader {
        self.retry = retry;
        self
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

    /// Reads into `buf` until at least `need` bytes have arrived, trying
    /// again after transient errors as the retry policy allows; the bytes
    /// already read are kept. A short read (injected ones included) keeps to
    /// multiples of `align`.
    fn read_into(&self, file: &File, buf: &mut [u8], offset: u64, need: usize, align: usize) -> io::Result<()> {
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(d) = self.faults.delay {
            std::thread::sleep(d);
        }
        let mut done = 0;
        let mut attempt = 0;
        loop {
            match self.attempt(file, buf, offset, need, align, n, attempt, &mut done) {
                Ok(()) => return Ok(()),
                Err(e) if attempt < self.retry.retries && is_transient(&e) => {
                    self.retried.fetch_add(1, Ordering::Relaxed);
                    log::warn!("read {n} at offset {offset}: {e}; trying again ({} of {})", attempt + 1, self.retry.retries);
                    std::thread::sleep(self.retry.backoff * 2u32.pow(attempt));
                    attempt += 1;
                }
                Err(e) if attempt > 0 => return Err(io::Error::new(e.kind(), format!("{e} (after {} tries)", attempt + 1))),
                Err(e) => return Err(e),
            }
        }
    }

    /// One try of `read_into`, from `*done` bytes on.
    #[allow(clippy::too_many_arguments)]
    fn attempt(&self, file: &File, buf: &mut [u8], offset: u64, need: usize, align: usize, n: u64, attempt: u32, done: &mut usize) -> io::Result<()> {
        let mut injected = self.faults.fault_for(n, attempt);
        while *done < need {
            let d = *done;
            let got = match injected.take() {
                Some(Fault::Eio) => Err(io::Error::other(InjectedEio(n))),
                Some(Fault::Eintr) => Err(io::Error::from(io::ErrorKind::Interrupted)),
                Some(Fault::Short) => {
                    let half = ((buf.len() - d) / 2 / align * align).max(align).min(buf.len() - d);
                    file.read_at(&mut buf[d..d + half], offset + d as u64)
                }
                Some(Fault::Eof) => Ok(0),
                Some(Fault::Panic) => panic!("injected panic on read {n} (SDQ_FAULT_READ)"),
                None => file.read_at(&mut buf[d..], offset + d as u64),
            };
            match got {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("file ended after {d} of {need} bytes at offset {offset}"))),
                Ok(k) => *done += k,
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

    /// Tries repeated after a transient error, so far.
    pub fn retried(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
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

    const QUICK: RetryPolicy = RetryPolicy { retries: 2, backoff: Duration::from_millis(1) };

    #[test]
    fn reads_exactly_or_fails() {
        let (path, f) = scratch_file("exact");
        let r = ExpertReader::new(FaultPlan::parse("3").unwrap()).with_retries(QUICK);
        let mut buf = [0u8; 16];
        r.read_exact_at(&f, &mut buf, 16).unwrap();
        assert_eq!(buf[0], 16);
        let e = r.read_exact_at(&f, &mut buf, 250).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        let e = r.read_exact_at(&f, &mut buf, 0).unwrap_err();
        assert!(e.to_string().contains("injected read fault: EIO on read 3 (SDQ_FAULT_READ) (after 3 tries)"), "{e}");
        r.read_exact_at(&f, &mut buf, 0).unwrap();
        // The early end of file (read 2) and read 3 were each tried 3 times.
        assert_eq!(r.retried(), 4);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn transient_errors_are_retried_with_backoff() {
        let (path, f) = scratch_file("transient");
        let slow = RetryPolicy { retries: 3, backoff: Duration::from_millis(20) };
        let r = ExpertReader::new(FaultPlan::parse("eio@1*2, eof@2*3").unwrap()).with_retries(slow);
        let start = std::time::Instant::now();
        let mut buf = [0u8; 40];
        r.read_exact_at(&f, &mut buf, 10).unwrap();
        // Two failed tries: 20 + 40 ms of backoff.
        assert!(start.elapsed() >= Duration::from_millis(60), "{:?}", start.elapsed());
        assert!(buf.iter().enumerate().all(|(i, &b)| b as usize == 10 + i), "{buf:?}");
        // The file "ends" three times; the fourth try reads it all.
        r.read_exact_at(&f, &mut buf, 100).unwrap();
        assert!(buf.iter().enumerate().all(|(i, &b)| b as usize == 100 + i), "{buf:?}");
        assert_eq!((r.reads(), r.retried()), (2, 5));
        // No retries: the first transient error is the answer.
        let none = ExpertReader::new(FaultPlan::parse("eio@1*1").unwrap()).with_retries(RetryPolicy { retries: 0, ..slow });
        assert!(none.read_exact_at(&f, &mut buf, 0).is_err());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn interrupted_and_short_reads_complete_and_early_eof_fails() {
        let (path, f) = scratch_file("faults");
        let r = ExpertReader::new(FaultPlan::parse("eintr@1, short@2, eof@3").unwrap()).with_retries(QUICK);
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
        let at = |read, onward, fault, times| PlannedFault { read, onward, fault, times };
        assert_eq!(p.at, vec![at(4, false, Fault::Eio, None), at(1, false, Fault::Short, None)]);
        assert_eq!(p.delay, Some(Duration::from_millis(20)));
        assert_eq!(FaultPlan::parse("7").unwrap().at, vec![at(7, false, Fault::Eio, None)]);
        assert_eq!(FaultPlan::parse("eof@2*3").unwrap().at, vec![at(2, false, Fault::Eof, Some(3))]);
        let died = FaultPlan::parse("eio@5+").unwrap();
        assert_eq!(died.at, vec![at(5, true, Fault::Eio, None)]);
        assert_eq!((died.fault_for(4, 0), died.fault_for(5, 0), died.fault_for(900, 3)), (None, Some(Fault::Eio), Some(Fault::Eio)));
        let switch = std::env::temp_dir().join(format!("sdq-eio-while-{}", std::process::id()));
        let toggled = FaultPlan::parse(&format!("eio-while={}", switch.display())).unwrap();
        assert_eq!(toggled.fault_for(1, 0), None);
        std::fs::write(&switch, b"").unwrap();
        assert_eq!((toggled.fault_for(1, 0), toggled.fault_for(2, 3)), (Some(Fault::Eio), Some(Fault::Eio)));
        std::fs::remove_file(&switch).unwrap();
        assert_eq!(toggled.fault_for(3, 0), None);
        let ended = FaultPlan::parse(&format!("eio@5+,while={}", switch.display())).unwrap();
        std::fs::write(&switch, b"").unwrap();
        assert_eq!((ended.fault_for(4, 0), ended.fault_for(5, 0)), (None, Some(Fault::Eio)));
        std::fs::remove_file(&switch).unwrap();
        assert_eq!(ended.fault_for(6, 0), None);
        for (bad, needle) in [
            ("boom@3", "unknown fault 'boom'"),
            ("eio@0", "not a read number"),
            ("delay=x", "milliseconds"),
            ("eio@3*0", "not a number of attempts"),
            ("short@3*2", "only eio and eof take *K"),
            ("eintr@3+", "only eio and eof take N+"),
            ("eio-while=", "needs a path"),
            ("while=", "needs a path"),
        ] {
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
