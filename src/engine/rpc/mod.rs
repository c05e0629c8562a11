//! Across machines: ggml's RPC backend with the pager on every node.
//!
//! A host (`llama-cli --rpc A,B --ram-budget ..`) places whole layers on RPC
//! nodes as upstream does, but the routed experts of a node's layers are not
//! sent: the host claims each such weight for the node ([`host`]), with the
//! file, offset and header fingerprint it has in the host's copy of the
//! model, and the node (`rpc-server -m FILE --ram-budget ..`, [`node`])
//! answers sdq's 4 KiB only if its own copy has the same bytes there. Its
//! pager then reads them from its own disk into its own arena. sdq's expert
//! op crosses the wire by name (`sdq_rpc_op`), bound on the node to the
//! node's own function and pager.

pub mod host;
pub mod node;

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What a node answers to a claim it takes: the bytes the weight takes in
/// its RPC buffer (as a weight in sdq's paged buffer type does locally).
pub const CLAIMED_BYTES: u64 = 4096;

/// Why a node refuses a claim: its answer instead of [`CLAIMED_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Refusal {
    /// The node's model has no such split file.
    NoSuchFile = 1,
    /// The node's file has another size.
    FileSize = 2,
    /// The node's file has another GGUF header (metadata or tensor table).
    Header = 3,
    /// The node's file has no such tensor at that offset with that type and shape.
    Tensor = 4,
    /// The claim is not for a routed expert, or the node cannot page it.
    NotPageable = 5,
    /// The node's copy of the tensor has other bytes (a model of the same
    /// shapes with other weights).
    Bytes = 6,
}

impl Refusal {
    pub fn from_answer(answer: u64) -> Option<Refusal> {
        [Refusal::NoSuchFile, Refusal::FileSize, Refusal::Header, Refusal::Tensor, Refusal::NotPageable, Refusal::Bytes]
            .into_iter()
            .find(|r| *r as u64 == answer)
    }

    pub fn reason(self) -> &'static str {
        match self {
            Refusal::NoSuchFile => "its copy of the model has no such split file",
            Refusal::FileSize => "its copy of this file has another size",
            Refusal::Header => "its copy of this file has another GGUF header (another model, quantization or split)",
            Refusal::Tensor => "its copy of this file has no such tensor at this offset, type and shape",
            Refusal::NotPageable => "it cannot page this tensor",
            Refusal::Bytes => "its copy of this tensor has other bytes (a model of the same shapes with other weights)",
        }
    }
}

/// What both sides compare of one model file: its size and a fingerprint of
/// its GGUF header (magic, metadata and tensor table, up to the data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    pub size: u64,
    pub header_hash: u64,
}

/// The file's [`FileId`], computed once per path.
pub fn file_id(path: &Path) -> Result<FileId> {
    static KNOWN: Mutex<Option<HashMap<PathBuf, FileId>>> = Mutex::new(None);
    if let Some(id) = KNOWN.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).get(path) {
        return Ok(*id);
    }
    let gguf = crate::engine::model::gguf::Gguf::open(path)?;
    let header = gguf.data_offset();
    drop(gguf);
    let mut file = std::fs::File::open(path).map_err(|e| Error::io("cannot open", path, e))?;
    let size = file.metadata().map_err(|e| Error::io("cannot stat", path, e))?.len();
    let mut hash = Fnv1a::default();
    let mut left = header;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let n = buf.len().min(left as usize);
        file.read_exact(&mut buf[..n]).map_err(|e| Error::io("cannot read the GGUF header of", path, e))?;
        hash.write(&buf[..n]);
        left -= n as u64;
    }
    let id = FileId { size, header_hash: hash.0 };
    KNOWN.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).insert(path.to_path_buf(), id);
    Ok(id)
}

/// A fingerprint of a weight's bytes in `path` (`size` bytes at `offset`):
/// its first and last 4 KiB, which differ between models of the same
/// shapes (another seed, another fine-tune).
pub fn sample_hash(path: &Path, offset: u64, size: u64) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(|e| Error::io("cannot open", path, e))?;
    let n = size.min(4096);
    let mut buf = vec![0u8; n as usize];
    let mut hash = Fnv1a::default();
    for at in [offset, offset + size - n] {
        file.read_exact_at(&mut buf, at).map_err(|e| Error::io("cannot read a weight of", path, e))?;
        hash.write(&buf);
    }
    Ok(hash.0)
}

/// 64-bit FNV-1a: the header fingerprint (a check that two copies are the
/// same file, not a defence against a forged one).
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_round_trip_and_never_look_like_a_claim_taken() {
        for r in [Refusal::NoSuchFile, Refusal::FileSize, Refusal::Header, Refusal::Tensor, Refusal::NotPageable, Refusal::Bytes] {
            assert_eq!(Refusal::from_answer(r as u64), Some(r));
            assert_ne!(r as u64, CLAIMED_BYTES);
        }
        assert_eq!(Refusal::from_answer(CLAIMED_BYTES), None);
        assert_eq!(Refusal::from_answer(0), None);
    }

    #[test]
    fn fnv1a_matches_the_reference_values() {
        let mut h = Fnv1a::default();
        h.write(b"");
        assert_eq!(h.0, 0xcbf2_9ce4_8422_2325);
        let mut h = Fnv1a::default();
        h.write(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
    }
}
