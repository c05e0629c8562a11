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
    /// A flag or an environment variable (`name`) has a value sdq cannot use.
    Flag { name: String, message: String },
    /// The RAM budget cannot hold what it must (or is beyond this
    /// machine's RAM); `minimum` is the least that would do, where known.
    Budget { budget: u64, minimum: Option<u64>, message: String },
    /// A model's tensors are not what sdq can page (a type the CPU cannot
    /// multiply, a geometry the arena cannot plan for).
    Model(String),
    /// An expert could not be read from its file (after the retries): the
    /// batch that needed it stops.
    Read(String),
    /// The system refused memory or a thread.
    Resource(String),
    /// Anything else a caller does not tell apart: a value, a command's
    /// state.
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

    pub fn flag(name: impl Into<String>, message: impl Into<String>) -> Error {
        Error::Flag { name: name.into(), message: message.into() }
    }

    pub fn budget(budget: u64, minimum: Option<u64>, message: impl Into<String>) -> Error {
        Error::Budget { budget, minimum, message: message.into() }
    }

    pub fn model(message: impl Into<String>) -> Error {
        Error::Model(message.into())
    }

    pub fn resource(message: impl Into<String>) -> Error {
        Error::Resource(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { context, path, source } => write!(f, "{context} {}: {source}", path.display()),
            Error::Gguf { path, message } => write!(f, "{}: {message}", path.display()),
            Error::Format { path, line, message } => write!(f, "{}:{line}: {message}", path.display()),
            Error::Flag { message, .. } | Error::Budget { message, .. } => f.write_str(message),
            Error::Model(message) | Error::Read(message) | Error::Resource(message) | Error::Invalid(message) | Error::Internal(message) => {
                f.write_str(message)
            }
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
