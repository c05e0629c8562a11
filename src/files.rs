//! Files sdq rewrites while other programs may read them (the stats file,
//! hot sets): each replaced whole, never seen half written.

/// Replaces the file at `path` with `text` whole, through a temporary file
/// beside it and a rename, so a reader never sees half of it (the stats
/// file, hot sets).
pub fn write_whole(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
