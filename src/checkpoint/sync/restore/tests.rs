//! How a restore groups its entries into units of work.

use super::*;

fn entry(name: &str, size: u64) -> TreeEntry {
    TreeEntry {
        name: name.into(),
        content: EntryContent::Symlink(b"x".to_vec()),
        mode: 0o777,
        mtime_ns: 0,
        size,
        xattrs: Vec::new(),
    }
}

#[test]
fn units_group_neighbours_up_to_the_limit_and_leave_large_entries_alone() {
    let sizes = [3, 4, 0, 5, 11, 2, 10, 1];
    let entries: Vec<TreeEntry> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| entry(&format!("e{i}"), n))
        .collect();
    let got = units(&entries, |e| e.size, 10);
    use Unit::*;
    assert_eq!(
        got,
        vec![
            Group(vec![0, 1, 2]),
            One(4),
            Group(vec![3, 5]),
            Group(vec![6]),
            Group(vec![7]),
        ]
    );
    // Every entry in exactly one unit.
    let mut seen: Vec<usize> = got
        .iter()
        .flat_map(|u| match u {
            One(i) => vec![*i],
            Group(g) => g.clone(),
        })
        .collect();
    seen.sort();
    assert_eq!(seen, (0..entries.len()).collect::<Vec<_>>());
    assert!(units(&[], |e| e.size, 10).is_empty());
}
