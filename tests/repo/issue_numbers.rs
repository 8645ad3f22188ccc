//! No issue numbers in code or docs: a comment says why in its own words, and a reader needs
//! no tracker to follow it. Every source, script, manifest and document the project writes is
//! scanned for what the regex `[Ii]ssues? #?[0-9]+` matches; fixture data and generated golden
//! files are not prose and are left out (the fixture generators are scanned).

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Folders scanned whole (for the extensions below).
const TREES: &[&str] = &[
    "src",
    "probes/src",
    "probes/benches",
    "tests",
    "benches",
    "deploy",
    "charts",
    "docs",
    ".ci",
    "scripts",
];

/// Single files, and the folder whose top level alone is scanned.
const FILES: &[&str] = &[
    "README.md",
    "Cargo.toml",
    "probes/Cargo.toml",
    "Dockerfile",
    "daemonset.yaml",
    ".ci/run",
];
const TOP_LEVEL_ONLY: &str = "probes/tests";

const EXTENSIONS: &[&str] = &[
    "rs", "sh", "bash", "py", "yaml", "yml", "md", "toml", "go", "tpl",
];

/// Data, not prose: generated golden files, the VM tests' kernel cache (git-ignored) and the
/// fixture trees, of which only the generators (`*.py`) are scanned.
const SKIPPED: &[&str] = &["tests/golden", "tests/vm/cache"];
const FIXTURES: &str = "tests/fixtures";

/// Whether `line` has a match of `[Ii]ssues? #?[0-9]+`.
fn cites_issue(line: &str) -> bool {
    let b = line.as_bytes();
    (0..b.len()).any(|i| {
        let rest = &b[i..];
        let Some(rest) = rest
            .strip_prefix(b"issue")
            .or_else(|| rest.strip_prefix(b"Issue"))
        else {
            return false;
        };
        let rest = rest.strip_prefix(b"s").unwrap_or(rest);
        let Some(rest) = rest.strip_prefix(b" ") else {
            return false;
        };
        let rest = rest.strip_prefix(b"#").unwrap_or(rest);
        rest.first().is_some_and(u8::is_ascii_digit)
    })
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

fn has_extension(path: &Path, wanted: &[&str]) -> bool {
    path.extension()
        .and_then(|x| x.to_str())
        .is_some_and(|x| wanted.contains(&x))
}

/// The files of `dir` to scan, recursively unless `top_only`. Symlinks are not followed (the
/// fixture trees are full of them).
fn walk(dir: &Path, top_only: bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let Ok(kind) = e.file_type() else { continue };
        let path = e.path();
        let name = rel(&path);
        if kind.is_dir() {
            if !top_only && e.file_name() != "target" && !SKIPPED.contains(&name.as_str()) {
                walk(&path, false, out);
            }
        } else if kind.is_file() {
            let wanted = if name.starts_with(&format!("{FIXTURES}/")) {
                &["py"][..]
            } else {
                EXTENSIONS
            };
            if has_extension(&path, wanted) {
                out.push(path);
            }
        }
    }
}

fn scanned_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for tree in TREES {
        walk(&root().join(tree), false, &mut out);
    }
    walk(&root().join(TOP_LEVEL_ONLY), true, &mut out);
    for file in FILES {
        let path = root().join(file);
        if path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn no_issue_numbers_in_code_or_docs() {
    let files = scanned_files();
    assert!(
        files.len() > 100,
        "the scan found only {} files: {files:?}",
        files.len()
    );
    let mut found = Vec::new();
    for path in &files {
        let name = rel(path);
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if cites_issue(line) {
                found.push(format!("{name}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "issue numbers in code or docs (say why in words instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn issue_citations_are_matched_as_the_regex_does() {
    // Built from pieces, so that this file does not cite an issue itself.
    let cite = |rest: &str| format!("{}{rest}", ["Is", "sue"].concat());
    let lower = |rest: &str| format!("{}{rest}", ["is", "sue"].concat());
    for hit in [
        cite(" 36, item 3"),
        lower(" #12"),
        lower("s 2 and 17"),
        format!("(red team {})", lower(" 36")),
        lower("'s bound, then ") + &lower(" 7"),
    ] {
        assert!(cites_issue(&hit), "{hit:?} cites an issue");
    }
    for miss in [
        lower("'s bound"),
        lower("s"),
        lower(" tracker"),
        lower("  5"),
        lower("#5"),
        cite(": 5"),
        "ISSUE 5".to_owned(),
        String::new(),
    ] {
        assert!(!cites_issue(&miss), "{miss:?} cites no issue");
    }
}
