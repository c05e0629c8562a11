//! The crate's error type: what was being done, and why it failed.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// An error with enough context to act on: the file, tensor, value or limit involved.
#[derive(Debug)]
pub enum Error {
    /// An I/O operation on `path` failed.
    Io { context: String, path: PathBuf, source: io::Error },
    /// A GGUF file could not be read or does not hold what is needed.
    Gguf { path: PathBuf, message: String },
    /// A text file sdq reads (a routing trace, a hot set) is malformed at `line`.
    Format { path: PathBuf, line: usize, message: String },
    /// A value given by the user (flag, preset, size) is not acceptable.
    Invalid(String),
    /// sdq's own code failed (a panic, caught): a bug, with what it was
    /// doing and where.
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(context: impl Into<String>, path: &Path, source: io::Error) -> Error {
        Error::Io { context: context.into(), path: path.to_path_buf(), source }
    }

    pub fn gguf(path: &Path, message: impl Into<String>) -> Error {
        Error::Gguf { path: path.to_path_buf(), message: message.into() }
    }

    pub fn format(path: &Path, line: usize, message: impl Into<String>) -> Error {
        Error::Format { path: path.to_path_buf(), line, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Error {
        Error::Invalid(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { context, path, source } => write!(f, "{context} {}: {source}", path.display()),
            Error::Gguf { path, message } => write!(f, "{}: {message}", path.display()),
            Error::Format { path, line, message } => write!(f, "{}:{line}: {message}", path.display()),
            Error::Invalid(message) | Error::Internal(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
