//! Byte counts as people write them: `4096`, `512MiB`, `2GiB`, `64G`.

/// Parses a byte count: a number with an optional K/M/G (powers of 1000)
/// or KiB/MiB/GiB (powers of 1024) suffix.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 4096, 512MiB, 2GiB)"))?;
    let mul: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" => 1000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        u => return Err(format!("unknown unit {u:?} (use K, M, G, KiB, MiB, GiB)")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("{s:?} overflows"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn suffixes_are_powers_of_1000_or_1024() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2K"), Ok(2000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes(" 2GiB "), Ok(2 << 30));
        assert!(parse_bytes("12XB").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("99999999999999GiB").is_err());
    }
}
