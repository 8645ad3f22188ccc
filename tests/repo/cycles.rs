//! No import cycle between files of `src/` and `probes/src/`: the file-level import graph,
//! built from `use` trees and inline paths (`crate::a::b`, `super::x`, `self::x`, a child
//! module's name, `fabricgate_probes::`), has no loop. A path resolves to the deepest module
//! with a file of its own (`a/b.rs` or `a/b/mod.rs`); an item resolves to its module's file.
//!
//! Two kinds of import do not tie files into a loop, as a module tree reads: a re-export
//! (`pub use`, `pub(crate) use`: the parent module handing its children's names on), and a
//! file's import from a module it is part of (a child taking its parent's shared items, or
//! the crate root's). Test files (`tests.rs`, `*_tests.rs`, a `tests/` folder) are not part
//! of the graph.

use super::boundaries::{code_only, tokens};
use crate::common;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One crate: the name others import it by, its folder (relative to the repository), its
/// root file and whether its other files are modules of it (a binary beside a library in the
/// same folder has none).
struct Crate {
    name: &'static str,
    dir: &'static str,
    root: &'static str,
    modules: bool,
}

const CRATES: &[Crate] = &[
    Crate {
        name: "fabricgate",
        dir: "src",
        root: "lib.rs",
        modules: true,
    },
    Crate {
        name: "fabricgate-bin",
        dir: "src",
        root: "main.rs",
        modules: false,
    },
    Crate {
        name: "fabricgate_probes",
        dir: "probes/src",
        root: "lib.rs",
        modules: true,
    },
];

/// A file of a crate: the crate's index in the list and the file's module path.
type Module = (usize, Vec<String>);

/// For each file, the files it imports and the names it takes from each.
type Graph = BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>;

fn is_test_file(rel: &Path) -> bool {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    name == "tests.rs"
        || name.ends_with("_tests.rs")
        || rel
            .parent()
            .is_some_and(|p| p.components().any(|c| c.as_os_str() == "tests"))
}

/// `a/b.rs` and `a/b/mod.rs` are module `a::b`; the root file is the crate itself.
fn module_path(rel_to_crate: &Path, root: &str) -> Vec<String> {
    if rel_to_crate == Path::new(root) {
        return Vec::new();
    }
    let mut parts: Vec<String> = rel_to_crate
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    if last != "mod.rs" {
        parts.push(last.trim_end_matches(".rs").to_owned());
    }
    parts
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Every path a `use` tree names (the tokens between `use` and `;`): groups expanded, `self`
/// in a group and a glob naming the module itself, aliases dropped.
fn use_paths(tree: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut pos = 0;
    use_tree(tree, &mut pos, &[], &mut out);
    out
}

fn use_tree(t: &[String], pos: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    while let Some(tok) = t.get(*pos) {
        *pos += 1;
        match tok.as_str() {
            "::" => {}
            "*" => break,
            "{" => {
                while *pos < t.len() && t[*pos] != "}" {
                    let before = *pos;
                    use_tree(t, pos, &path, out);
                    if t.get(*pos).is_some_and(|x| x == ",") || *pos == before {
                        *pos += 1;
                    }
                }
                *pos += 1;
                return;
            }
            "self" if !path.is_empty() && t.get(*pos).is_none_or(|x| x != "::") => {
                skip_alias(t, pos);
                break;
            }
            ident if is_ident(ident) => {
                path.push(ident.to_owned());
                if t.get(*pos).is_none_or(|x| x != "::") {
                    skip_alias(t, pos);
                    break;
                }
            }
            _ => return,
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
}

fn skip_alias(t: &[String], pos: &mut usize) {
    if t.get(*pos).is_some_and(|x| x == "as") {
        *pos += 2;
    }
}

/// Whether the `use` at `at` is a re-export: `pub use`, `pub(crate) use`, `pub(super) use`.
fn is_reexport(t: &[String], at: usize) -> bool {
    match at.checked_sub(1).map(|i| t[i].as_str()) {
        Some("pub") => true,
        Some(")") => {
            let open = t[..at].iter().rposition(|x| x == "(");
            open.and_then(|o| o.checked_sub(1))
                .is_some_and(|p| t[p] == "pub")
        }
        _ => false,
    }
}

/// One path as written in a file: where it starts and what it names.
struct Named {
    /// The module the path is written in (the file's, or an inline module's inside it).
    from: Vec<String>,
    segments: Vec<String>,
}

/// The paths a file's code names outside re-exports: `use` trees and inline paths whose
/// first segment is `crate`, `super`, `self`, or any name (resolved later, when it names a
/// crate or a child module).
fn named_paths(text: &str, module: &[String]) -> Vec<Named> {
    let t = tokens(&code_only(text));
    let mut out = Vec::new();
    // Inline modules open here: their name and the brace depth they opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let here = |inline: &[(String, usize)]| {
        let mut m = module.to_vec();
        m.extend(inline.iter().map(|(n, _)| n.clone()));
        m
    };
    let mut i = 0;
    while i < t.len() {
        match t[i].as_str() {
            "use" => {
                let end = t[i..]
                    .iter()
                    .position(|x| x == ";")
                    .map_or(t.len(), |p| i + p);
                if !is_reexport(&t, i) {
                    let from = here(&inline);
                    for segments in use_paths(&t[i + 1..end]) {
                        out.push(Named {
                            from: from.clone(),
                            segments,
                        });
                    }
                }
                i = end + 1;
                continue;
            }
            "mod" if t.get(i + 2).is_some_and(|x| x == "{") => {
                inline.push((t[i + 1].clone(), depth));
            }
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            first
                if is_ident(first)
                    && t.get(i + 1).is_some_and(|x| x == "::")
                    && (i == 0 || t[i - 1] != "::" && t[i - 1] != ".") =>
            {
                let mut segments = vec![first.to_owned()];
                let mut j = i + 1;
                while t.get(j).is_some_and(|x| x == "::")
                    && t.get(j + 1).is_some_and(|x| is_ident(x))
                {
                    segments.push(t[j + 1].clone());
                    j += 2;
                }
                out.push(Named {
                    from: here(&inline),
                    segments,
                });
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The import graph of the crates under `repo`.
fn import_graph(repo: &Path, crates: &[Crate]) -> Graph {
    // Every module that has a file, and the other way round.
    let mut files: BTreeMap<Module, PathBuf> = BTreeMap::new();
    let mut modules: BTreeMap<PathBuf, Module> = BTreeMap::new();
    for (k, c) in crates.iter().enumerate() {
        let dir = repo.join(c.dir);
        for file in common::rust_files(&dir) {
            let rel = file.strip_prefix(&dir).unwrap().to_path_buf();
            let is_root = rel == Path::new(c.root);
            let is_other_root = crates
                .iter()
                .any(|o| o.dir == c.dir && o.root != c.root && rel == Path::new(o.root));
            if is_test_file(&rel) || is_other_root || !(is_root || c.modules) {
                continue;
            }
            let module = (k, module_path(&rel, c.root));
            let path = Path::new(c.dir).join(&rel);
            files.insert(module.clone(), path.clone());
            modules.insert(path, module);
        }
    }
    let mut graph = Graph::new();
    for (path, (k, module)) in &modules {
        let text = std::fs::read_to_string(repo.join(path)).unwrap();
        let edges = graph.entry(path.clone()).or_default();
        for named in named_paths(&text, module) {
            let Some((target, name)) = resolve(crates, &files, *k, &named) else {
                continue;
            };
            let (tk, tm) = &modules[&target];
            // A file's own module, and the modules it is part of, are no loop.
            let ancestor = *tk == *k && tm.len() <= module.len() && module.starts_with(tm);
            if !ancestor {
                edges.entry(target).or_default().insert(name);
            }
        }
    }
    graph
}

/// The file a path names, and the name it takes there; `None` for another crate's path
/// (std, serde, ...).
fn resolve(
    crates: &[Crate],
    files: &BTreeMap<Module, PathBuf>,
    k: usize,
    named: &Named,
) -> Option<(PathBuf, String)> {
    let s = &named.segments;
    let supers = s.iter().take_while(|x| *x == "super").count();
    let (krate, full): (usize, Vec<String>) = match s[0].as_str() {
        "crate" => (k, s[1..].to_vec()),
        "self" => (k, [named.from.as_slice(), &s[1..]].concat()),
        "super" => {
            let base = named.from.len().checked_sub(supers)?;
            (k, [&named.from[..base], &s[supers..]].concat())
        }
        first => {
            if let Some(other) = crates.iter().position(|c| c.name == first) {
                (other, s[1..].to_vec())
            } else {
                // A child module of the one the path is written in (edition 2018 paths).
                let child = [named.from.as_slice(), &s[..1]].concat();
                let has_file = files.contains_key(&(k, child.clone()));
                if !has_file {
                    return None;
                }
                (k, [named.from.as_slice(), s].concat())
            }
        }
    };
    (0..=full.len()).rev().find_map(|n| {
        let file = files.get(&(krate, full[..n].to_vec()))?;
        let name = full.get(n).or(full.last()).cloned().unwrap_or_default();
        Some((file.clone(), name))
    })
}

/// The loops of the graph: each set of files that reach one another (a strongly connected
/// component of more than one file), in path order.
fn cycles(graph: &Graph) -> Vec<Vec<PathBuf>> {
    let nodes: Vec<&PathBuf> = graph.keys().collect();
    let index: BTreeMap<&PathBuf, usize> = nodes.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    let out_edges: Vec<Vec<usize>> = nodes
        .iter()
        .map(|p| {
            graph[*p]
                .keys()
                .filter_map(|t| index.get(t).copied())
                .collect()
        })
        .collect();
    let reach = |from: usize| {
        let mut seen = vec![false; nodes.len()];
        let mut stack = vec![from];
        while let Some(n) = stack.pop() {
            for &m in &out_edges[n] {
                if !seen[m] {
                    seen[m] = true;
                    stack.push(m);
                }
            }
        }
        seen
    };
    let reaches: Vec<Vec<bool>> = (0..nodes.len()).map(reach).collect();
    let mut done = vec![false; nodes.len()];
    let mut out = Vec::new();
    for a in 0..nodes.len() {
        if done[a] || !reaches[a][a] {
            continue;
        }
        let loop_: Vec<usize> = (0..nodes.len())
            .filter(|&b| reaches[a][b] && reaches[b][a])
            .collect();
        for &b in &loop_ {
            done[b] = true;
        }
        if loop_.len() > 1 {
            out.push(loop_.iter().map(|&b| nodes[b].clone()).collect());
        }
    }
    out
}

/// A loop and what ties it: each file's imports from the others, with the names taken.
fn describe(graph: &Graph, files: &[PathBuf]) -> String {
    let mut text = format!(
        "{}:",
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for f in files {
        for (to, names) in &graph[f] {
            if files.contains(to) {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                text.push_str(&format!(
                    "\n  {} -> {}: {}",
                    f.display(),
                    to.display(),
                    names.join(", ")
                ));
            }
        }
    }
    text
}

#[test]
fn no_files_import_each_other_in_a_loop() {
    let graph = import_graph(common::repo_root(), CRATES);
    assert!(graph.len() > 100, "{} files read", graph.len());
    let found: Vec<String> = cycles(&graph).iter().map(|c| describe(&graph, c)).collect();
    assert!(
        found.is_empty(),
        "files that import each other in a loop (move what both need below both):\n{}",
        found.join("\n")
    );
}

/// A crate of `files` (path, text) in a fresh folder, and the loops its checker finds.
fn loops_of(files: &[(&str, &str)]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let p = dir.path().join("src").join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let crates = [Crate {
        name: "demo",
        dir: "src",
        root: "lib.rs",
        modules: true,
    }];
    let graph = import_graph(dir.path(), &crates);
    cycles(&graph).iter().map(|c| describe(&graph, c)).collect()
}

const LIB: (&str, &str) = ("lib.rs", "pub mod a;\npub mod c;\n");

#[test]
fn a_loop_through_a_parent_a_child_and_a_cousin_is_found_and_named() {
    let got = loops_of(&[
        LIB,
        (
            "a/mod.rs",
            "pub mod b;\nuse b::Fb;\npub struct Fa;\npub fn fa() -> Fb { Fb }\n",
        ),
        (
            "a/b.rs",
            "use crate::c::Fc;\npub struct Fb;\npub fn fb() -> Fc { Fc }\n",
        ),
        (
            "c.rs",
            "// use crate::a::nothing;\npub struct Fc;\npub fn fc() -> crate::a::Fa { crate::a::Fa }\n",
        ),
    ]);
    assert_eq!(
        got,
        ["src/a/b.rs, src/a/mod.rs, src/c.rs:\
          \n  src/a/b.rs -> src/c.rs: Fc\
          \n  src/a/mod.rs -> src/a/b.rs: Fb\
          \n  src/c.rs -> src/a/mod.rs: Fa"]
    );
}

#[test]
fn two_siblings_importing_each_other_are_a_loop() {
    let got = loops_of(&[
        LIB,
        ("a/mod.rs", "mod x;\nmod y;\n"),
        ("a/x.rs", "use super::y::{self, Y};\npub struct X;\n"),
        ("a/y.rs", "pub struct Y;\nfn f() { let _ = super::x::X; }\n"),
        ("c.rs", ""),
    ]);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with("src/a/x.rs, src/a/y.rs:"), "{got:?}");
}

#[test]
fn a_child_using_its_parent_and_a_parent_re_exporting_its_child_are_no_loop() {
    // The child takes its parent's items (`super::`, `crate::` up the tree, a glob).
    let child_up = loops_of(&[
        LIB,
        (
            "a/mod.rs",
            "pub mod b;\nuse crate::c::Fc;\npub struct Fa;\npub fn fa() -> Fc { Fc }\n",
        ),
        (
            "a/b.rs",
            "use super::*;\nuse crate::a::Fa;\npub struct Fb;\n",
        ),
        ("c.rs", "use crate::a::b::Fb;\npub struct Fc;\n"),
    ]);
    assert!(child_up.is_empty(), "{child_up:?}");
    // The parent hands its child's name on (and may use it itself).
    let re_export = loops_of(&[
        LIB,
        (
            "a/mod.rs",
            "mod b;\npub use b::Fb;\npub(crate) use b::{self as bee};\npub fn fa() -> Fb { Fb }\n",
        ),
        ("a/b.rs", "use crate::c::Fc;\npub struct Fb;\n"),
        ("c.rs", "use crate::a::Fb;\npub struct Fc;\n"),
    ]);
    assert!(re_export.is_empty(), "{re_export:?}");
}

#[test]
fn inline_test_modules_paths_in_text_and_other_crates_are_no_imports() {
    let got = loops_of(&[
        LIB,
        ("a/mod.rs", "pub mod b;\npub struct Fa;\n"),
        (
            "a/b.rs",
            "use std::io;\nuse serde::Serialize;\n/// [`crate::c::Fc`]\nconst S: &str = \"crate::c::Fc\";\n\
             pub struct Fb;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::a::b::Fb;\n}\n",
        ),
        ("c.rs", "use crate::a::b::Fb;\npub struct Fc;\n"),
    ]);
    assert!(got.is_empty(), "{got:?}");
}

#[test]
fn use_trees_expand_groups_nesting_self_globs_and_aliases() {
    let t = tokens("{crate::{a::{self, B as C}, d::*, e}, ::std::io}");
    let got: Vec<String> = use_paths(&t).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        got,
        ["crate::a", "crate::a::B", "crate::d", "crate::e", "std::io"]
    );
    let t = tokens("super::super::x::Y");
    assert_eq!(use_paths(&t), [["super", "super", "x", "Y"]]);
}
