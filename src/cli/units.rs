//! Counts as the command line writes them (`10k`, `1m`): std only, so the bench
//! binaries take it in by path too.

/// `1000`, `10k` or `1m` as a number; none if it is not one.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim().to_ascii_lowercase();
    let (n, mul) = match s.strip_suffix('k') {
        Some(n) => (n, 1_000),
        None => match s.strip_suffix('m') {
            Some(n) => (n, 1_000_000),
            None => (s.as_str(), 1),
        },
    };
    n.parse::<usize>().ok().map(|n| n * mul)
}
