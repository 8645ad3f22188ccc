//! The committed fixture trees are exactly what their generators write: each generator runs
//! into a temporary folder and every tree it writes is compared with the committed one, entry
//! by entry (file bytes, symlink targets, folders), with nothing missing or extra.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What one entry of a tree is, by its path relative to the tree.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Symlink(PathBuf),
}

fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = e.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().to_owned();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let entry = if meta.file_type().is_symlink() {
                Entry::Symlink(std::fs::read_link(&path).unwrap())
            } else if meta.is_dir() {
                stack.push(path.clone());
                Entry::Dir
            } else {
                Entry::File(std::fs::read(&path).unwrap())
            };
            out.insert(rel, entry);
        }
    }
    out
}

/// Differences between two snapshots, one line each (at most 20).
fn differences(want: &BTreeMap<PathBuf, Entry>, got: &BTreeMap<PathBuf, Entry>) -> Vec<String> {
    let mut out = Vec::new();
    for (path, w) in want {
        match got.get(path) {
            None => out.push(format!("{}: committed, not generated", path.display())),
            Some(g) if g != w => out.push(format!(
                "{}: committed {}, generated {}",
                path.display(),
                describe(w),
                describe(g)
            )),
            Some(_) => {}
        }
    }
    for path in got.keys().filter(|p| !want.contains_key(*p)) {
        out.push(format!("{}: generated, not committed", path.display()));
    }
    out.truncate(20);
    out
}

fn describe(e: &Entry) -> String {
    match e {
        Entry::Dir => "a folder".into(),
        Entry::File(b) => format!("{} bytes {:?}", b.len(), String::from_utf8_lossy(b)),
        Entry::Symlink(t) => format!("a link to {}", t.display()),
    }
}

/// Run `script OUT` and compare every tree it wrote under OUT with `tests/fixtures/<tree>`.
fn regenerate_and_compare(script: &str) -> usize {
    let Some(python) = common::require_tool("python3", "apt-get install python3") else {
        return 0;
    };
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(python)
        .arg(common::fixture(script))
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success(), "{script} failed: {status}");
    let mut trees = 0;
    for e in std::fs::read_dir(out.path()).unwrap() {
        let generated = e.unwrap().path();
        let name = generated.file_name().unwrap().to_owned();
        let committed = common::fixture(&name.to_string_lossy());
        assert!(
            committed.is_dir(),
            "{script} writes {name:?}, which is not committed under tests/fixtures/"
        );
        let diff = differences(&snapshot(&committed), &snapshot(&generated));
        assert!(
            diff.is_empty(),
            "tests/fixtures/{} differs from what {script} writes (rerun it and commit):\n{}",
            name.to_string_lossy(),
            diff.join("\n")
        );
        trees += 1;
    }
    trees
}

#[test]
fn rdma_node_trees_are_what_generate_py_writes() {
    let trees = regenerate_and_compare("generate.py");
    if common::tool("python3").is_some() {
        assert!(trees >= 11, "generate.py wrote only {trees} trees");
    }
    // And no committed tree lacks a generator (the Lustre ones have their own; `admission/`
    // holds recorded AdmissionReview requests, not a node tree).
    let fixtures = common::fixture("");
    let out = tempfile::tempdir().unwrap();
    if let Some(python) = common::tool("python3") {
        let ok = Command::new(python)
            .arg(fixtures.join("generate.py"))
            .arg(out.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok);
        for e in std::fs::read_dir(&fixtures).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() && !name.starts_with("lustre-") && name != "admission" {
                assert!(
                    out.path().join(&name).is_dir(),
                    "tests/fixtures/{name} is committed but generate.py does not write it"
                );
            }
        }
    }
}

#[test]
fn lustre_trees_are_what_make_lustre_fixtures_py_writes() {
    let trees = regenerate_and_compare("make-lustre-fixtures.py");
    if common::tool("python3").is_some() {
        assert_eq!(trees, 5);
    }
}

/// The comparison itself notices a changed byte, a retargeted link and an extra file.
#[test]
fn the_comparison_catches_bytes_links_and_extra_entries() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for d in [a.path(), b.path()] {
        std::fs::create_dir_all(d.join("sys/class")).unwrap();
        std::fs::write(d.join("sys/state"), "4: ACTIVE\n").unwrap();
        std::os::unix::fs::symlink("../state", d.join("sys/class/link")).unwrap();
    }
    assert!(differences(&snapshot(a.path()), &snapshot(b.path())).is_empty());
    std::fs::write(b.path().join("sys/state"), "4: ACTIVE \n").unwrap();
    std::fs::remove_file(b.path().join("sys/class/link")).unwrap();
    std::os::unix::fs::symlink("../other", b.path().join("sys/class/link")).unwrap();
    std::fs::write(b.path().join("sys/extra"), "").unwrap();
    let diff = differences(&snapshot(a.path()), &snapshot(b.path())).join("\n");
    assert!(diff.contains("sys/state: committed 10 bytes"), "{diff}");
    assert!(
        diff.contains("sys/class/link: committed a link to ../state"),
        "{diff}"
    );
    assert!(
        diff.contains("sys/extra: generated, not committed"),
        "{diff}"
    );
}
