//! Reading expert bytes from the model file: positioned reads that retry
//! interrupted and short reads and fail on anything else, with an optional
//! injected fault (`SDQ_FAULT_READ=N` fails the N-th read with EIO).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Reads ranges of model files into slots.
#[derive(Debug, Default)]
pub struct ExpertReader {
    /// Fail the read with this 1-based sequence number (0: never).
    fault_at: u64,
    reads: AtomicU64,
}

impl ExpertReader {
    pub fn new(fault_at: Option<u64>) -> ExpertReader {
        ExpertReader { fault_at: fault_at.unwrap_or(0), reads: AtomicU64::new(0) }
    }

    /// Fills `buf` from `file` at `offset`. EINTR and short reads are retried
    /// until every byte has arrived; end of file before that is an error.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.fault_at {
            return Err(io::Error::other(format!("injected read fault (SDQ_FAULT_READ={n})")));
        }
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("file ended after {} of {} bytes at offset {offset}", done, buf.len()),
                    ))
                }
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        // The slot now holds these bytes; a second copy in the page cache
        // would only push out pages that are needed (the mapped weights),
        // and under a limit that counts page cache, it is charged too.
        drop_cached(file, offset, buf.len() as u64);
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

    #[test]
    fn reads_exactly_or_fails() {
        let path = std::env::temp_dir().join(format!("sdq-io-test-{}", std::process::id()));
        std::fs::File::create(&path).unwrap().write_all(&(0..=255u8).collect::<Vec<_>>()).unwrap();
        let f = File::open(&path).unwrap();
        let r = ExpertReader::new(Some(3));
        let mut buf = [0u8; 16];
        r.read_exact_at(&f, &mut buf, 16).unwrap();
        assert_eq!(buf[0], 16);
        let e = r.read_exact_at(&f, &mut buf, 250).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        let e = r.read_exact_at(&f, &mut buf, 0).unwrap_err();
        assert!(e.to_string().contains("SDQ_FAULT_READ=3"), "{e}");
        r.read_exact_at(&f, &mut buf, 0).unwrap();
        std::fs::remove_file(path).unwrap();
    }
}
