//! `shm_layout.md` is the byte-level truth: every table of a shared struct in
//! it must list exactly the struct's fields, in order, with their offsets and
//! sizes.

use std::collections::BTreeMap;

/// `### Name` sections followed by a `| offset | size | field | ...` table.
fn doc_tables(md: &str) -> BTreeMap<String, Vec<(String, usize, usize)>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in md.lines() {
        if let Some(name) = line.strip_prefix("### ") {
            current = Some(name.trim().to_string());
            continue;
        }
        let Some(name) = current.as_ref() else {
            continue;
        };
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells.len() < 3 || cells[0] == "offset" || cells[0].starts_with("---") {
            continue;
        }
        let (Ok(off), Ok(size)) = (cells[0].parse::<usize>(), cells[1].parse::<usize>()) else {
            continue;
        };
        out.entry(name.clone())
            .or_insert_with(Vec::new)
            .push((cells[2].to_string(), off, size));
    }
    out
}

#[test]
fn shm_layout_md_matches_the_structs() {
    let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shm_layout.md"))
        .unwrap();
    let doc = doc_tables(&md);
    let code = kvring::layout::field_tables();
    assert!(!code.is_empty());
    for (name, fields) in &code {
        let Some(table) = doc.get(*name) else {
            panic!("shm_layout.md has no table for {name}")
        };
        let want: Vec<(String, usize, usize)> = fields
            .iter()
            .map(|(f, o, s)| (f.to_string(), *o, *s))
            .collect();
        assert_eq!(
            table, &want,
            "table {name} differs from the struct (field, offset, size)"
        );
    }
    for name in doc.keys() {
        assert!(
            code.iter().any(|(n, _)| n == name),
            "shm_layout.md documents {name}, which the code lacks"
        );
    }
}

#[test]
fn documented_version_is_the_code_version() {
    let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shm_layout.md"))
        .unwrap();
    let first = md.lines().next().unwrap();
    assert!(
        first.contains(&format!(
            "(layout version {})",
            kvring::layout::LAYOUT_VERSION
        )),
        "{first}"
    );
    assert!(md.contains(&format!("{:#018x}", kvring::layout::MAGIC)));
}
