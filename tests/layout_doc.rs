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

/// The repository's shm_layout.md (this test belongs to tools/kvring).
fn shm_layout_md() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shm_layout.md")).unwrap()
}

#[test]
fn shm_layout_md_matches_the_structs() {
    let md = shm_layout_md();
    let doc = doc_tables(&md);
    let code = kvring::shm::doc::field_tables();
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
    let md = shm_layout_md();
    let first = md.lines().next().unwrap();
    assert!(
        first.contains(&format!("(layout version {})", kvring::shm::LAYOUT_VERSION)),
        "{first}"
    );
    assert!(md.contains(&format!("{:#018x}", kvring::shm::MAGIC)));
}

/// The `| CODE NAME | ... | bound |` rows of the opcode table.
fn doc_opcodes(md: &str) -> Vec<(u16, String, String)> {
    let start = md
        .find("| opcode | request payload |")
        .expect("opcode table");
    md[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let (code, name) = cells.first()?.split_once(' ')?;
            let bound = cells.last()?.to_string();
            Some((code.parse().ok()?, name.to_string(), bound))
        })
        .collect()
}

#[test]
fn opcode_table_lists_every_operation() {
    use kvring::proto::{Opcode, OPS};
    use kvring::ring::{frame_bytes, HEADER_BYTES};
    let md = shm_layout_md();
    let doc = doc_opcodes(&md);
    let listed: Vec<(u16, String)> = doc.iter().map(|(c, n, _)| (*c, n.clone())).collect();
    let code: Vec<(u16, String)> = Opcode::ALL
        .iter()
        .map(|op| (op.raw(), op.name().to_uppercase()))
        .collect();
    assert_eq!(listed, code, "shm_layout.md's opcode table (code, NAME)");
    for ((_, name, bound), op) in doc.iter().zip(Opcode::ALL) {
        // A bound written as a number is the bound for any payload.
        if let Ok(n) = bound.parse::<usize>() {
            assert_eq!(n, op.completion_bound(0), "{name}'s completion bound");
            assert_eq!(n, op.completion_bound(4096), "{name}'s completion bound");
        }
    }
    // The stats index is dense and inside the stats region; every bound
    // covers at least a header.
    const { assert!(OPS <= kvring::shm::OP_STAT_SLOTS) };
    for (i, op) in Opcode::ALL.iter().enumerate() {
        assert_eq!(op.index(), i);
        assert_eq!(Opcode::decode(op.raw()), Ok(*op));
        assert!(op.completion_bound(0) >= HEADER_BYTES);
    }
    assert_eq!(Opcode::Ping.completion_bound(13), frame_bytes(13));
}
