//! Sizes as people and flags write them: `8G`, `6144M` or a byte count
//! parsed (`parse_size`), bytes shown as `7.45 GiB` (`human`). Binary units,
//! as in llama.cpp's own flags and output.

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// Parses a size: plain bytes (`123456`), or a number with a binary unit
/// (`512K`, `6144M`, `8G`, `8GiB`, `1.5G`, `1T`; case-insensitive, the `B`/`iB`
/// suffix optional). Units are powers of 1024, as in llama.cpp's own flags.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() || num.starts_with('.') || num.matches('.').count() > 1 {
        return Err(format!("'{text}' is not a size (expected e.g. 8G, 8GiB, 6144M or a byte count)"));
    }
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        "t" | "tb" | "tib" => 1024 * GIB,
        _ => return Err(format!("'{text}' has an unknown unit '{}' (use K, M, G or T)", unit.trim())),
    };
    let value: f64 = num.parse().map_err(|_| format!("'{text}' is not a size"))?;
    let bytes = value * mult as f64;
    // A byte count must be exact and fit comfortably in u64 (2^63).
    if !bytes.is_finite() || bytes >= 9.2e18 {
        return Err(format!("'{text}' is too large"));
    }
    if bytes < 1.0 {
        return Err(format!("'{text}' is zero"));
    }
    Ok(bytes as u64)
}

/// Formats bytes for people: `7.45 GiB`, `512.0 MiB`, `4096 B`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.1} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (s, v) in [
            ("8G", 8 * GIB),
            ("8GiB", 8 * GIB),
            ("8gb", 8 * GIB),
            ("6144M", 6144 * MIB),
            ("1.5G", 3 * GIB / 2),
            ("123456", 123_456),
            ("512k", 512 * KIB),
            (" 2T ", 2048 * GIB),
        ] {
            assert_eq!(parse_size(s), Ok(v), "{s}");
        }
        for bad in ["0", "-1", "8X", "99999999T", "", "G", "1.2.3G", ".5G", "0.0000001"] {
            assert!(parse_size(bad).is_err(), "{bad} accepted");
        }
        assert!(parse_size("8X").unwrap_err().contains("'8X'"));
    }
}
