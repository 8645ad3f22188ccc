//! The README stays a landing page with the two commands CI relies on (the run command's
//! setup lean, the test command's the one CI runs), and no link in it or in `docs/` points at
//! a file that does not exist.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn readme_is_a_landing_page_with_the_two_commands() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; move detail to docs/"
    );
    for command in [
        "./scripts/setup.sh && cargo run --release -- check",
        "./scripts/setup-tests.sh && ./scripts/test.sh",
    ] {
        assert!(
            readme.lines().any(|l| l.trim() == command),
            "README.md lost the command line {command:?}"
        );
    }
    // CI runs the README's test command: its test setup, then scripts/test.sh, in that order
    // (fmt and clippy may sit between them).
    let ci = read(".ci/run");
    let setup = ci
        .lines()
        .position(|l| l.trim() == "./scripts/setup-tests.sh");
    let test = ci.lines().position(|l| l.trim() == "./scripts/test.sh");
    assert!(
        matches!((setup, test), (Some(s), Some(t)) if s < t),
        ".ci/run must run ./scripts/setup-tests.sh, then ./scripts/test.sh:\n{ci}"
    );
}

/// The run command installs only what building and running need: its setup script runs no
/// test setup, and the test setup script runs it and then every `.ci/*.sh`.
#[test]
fn run_setup_is_lean_and_test_setup_runs_it_and_every_ci_script() {
    let run = read("scripts/setup.sh");
    for test_only in [
        ".ci/",
        "setup-tests",
        "qemu",
        "prometheus",
        "golang",
        "containerd",
    ] {
        assert!(
            !run.lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .any(|l| l.contains(test_only)),
            "scripts/setup.sh (the run command's setup) mentions {test_only:?}: test setup \
             belongs in scripts/setup-tests.sh or .ci/"
        );
    }
    let tests = read("scripts/setup-tests.sh");
    let code: Vec<&str> = tests
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    let calls_setup = code.iter().position(|l| l.contains("scripts/setup.sh"));
    let runs_ci = code.iter().position(|l| l.contains(".ci/*.sh"));
    assert!(
        matches!((calls_setup, runs_ci), (Some(s), Some(c)) if s < c),
        "scripts/setup-tests.sh must run scripts/setup.sh, then every .ci/*.sh:\n{tests}"
    );
}

/// Relative link targets of `[text](target)` in a Markdown text, without `#anchor`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = &rest[..end];
        let path = target.split('#').next().unwrap_or("");
        if !path.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            out.push(path.to_owned());
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut files: Vec<PathBuf> = vec![root().join("README.md")];
    let docs = std::fs::read_dir(root().join("docs")).expect("docs/ exists");
    files.extend(
        docs.filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "md")),
    );
    assert!(files.len() >= 7, "README.md and the docs/ files: {files:?}");
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let dir = file.parent().unwrap();
        for link in links(&text) {
            if !dir.join(&link).exists() {
                broken.push(format!("{}: {link}", file.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn link_extraction_finds_relative_targets_only() {
    let text = "see [a](docs/a.md#x), [b](https://example.com) and [c](#local)";
    assert_eq!(links(text), ["docs/a.md"]);
}

/// The code points readers at docs/, never at a design document outside the repository.
#[test]
fn code_refers_to_design_documents_inside_docs() {
    let mut offenders = Vec::new();
    for dir in ["src", "probes/src"] {
        for entry in crate::common::rust_files(&root().join(dir)) {
            let text = std::fs::read_to_string(&entry).unwrap_or_default();
            if text.contains("DESIGN.md") {
                offenders.push(entry.display().to_string());
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "DESIGN.md referenced in {offenders:?}"
    );
}

/// docs/design.md's tables of `src/`'s floors and feature folders name every source file of
/// the crate (tests aside), each in the row of its top folder: a file the map misses fails
/// here, with the row to add it to.
#[test]
fn design_floor_tables_name_every_source_file() {
    let root = crate::common::repo_root();
    let design = std::fs::read_to_string(root.join("docs/design.md")).unwrap();
    let section = design
        .split("## The floors of `src/`")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/design.md has the section \"The floors of `src/`\"");
    // First cell (the floor or feature, or its folder) → the row's text.
    let rows: Vec<(&str, &str)> = section
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| ---"))
        .filter_map(|l| {
            let mut cells = l.split(" | ");
            Some((cells.next()?.trim_start_matches("| "), l))
        })
        .collect();
    let src = root.join("src");
    let mut missing = Vec::new();
    for file in crate::common::rust_files(&src) {
        let rel = file.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        if parts
            .iter()
            .any(|p| p == "tests" || p.ends_with("_tests.rs") || p == "tests.rs")
            || matches!(parts.as_slice(), [f] if f == "lib.rs" || f == "main.rs")
        {
            continue;
        }
        let name = parts.last().unwrap();
        let top = &parts[0];
        // A file at the crate's root is its own row's or core's; a folder's, its folder's row
        // (`node/`, `transport/`), or core's for `config/`.
        let row = rows.iter().find(|(first, text)| {
            if parts.len() == 1 {
                first.contains(&format!("`{top}`")) || text.contains(&format!("`{top}`"))
            } else {
                first.contains(&format!("`{top}/`"))
                    || (*first == "core" && text.contains(&format!("`{top}/`")))
            }
        });
        let named = row.is_some_and(|(_, text)| {
            text.contains(&format!("`{name}`"))
                || (parts.len() > 2
                    && text.contains(&format!("`{}/`", parts[parts.len() - 2]))
                    && name == "mod.rs")
        });
        if !named {
            missing.push(format!(
                "src/{}: not named in the row of {} of docs/design.md's floor tables",
                rel.display(),
                row.map_or_else(|| format!("`{top}`"), |(f, _)| (*f).to_owned())
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
