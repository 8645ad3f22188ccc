//! The boundaries stay declared: no `unsafe` in the agent crate, `unsafe` in the probes crate
//! only inside the verbs wrapper, the floors of `src/` (each folder uses only the floors below
//! it, checked on parsed `use` trees and `crate::` paths, not substrings), a probes crate
//! without Kubernetes or tokio, and no source file over 900 lines. (The compiler enforces the
//! lint attributes; these tests keep anyone from quietly deleting them.)

use crate::common;

fn read(rel: &str) -> String {
    std::fs::read_to_string(common::repo_root().join(rel)).unwrap()
}

#[test]
fn the_agent_crate_forbids_unsafe() {
    for file in ["src/lib.rs", "src/main.rs"] {
        assert!(
            read(file)
                .lines()
                .any(|l| l.trim() == "#![forbid(unsafe_code)]"),
            "{file} lost #![forbid(unsafe_code)]"
        );
    }
}

#[test]
fn probes_allow_unsafe_on_the_verbs_module_only() {
    let lib = read("probes/src/lib.rs");
    for attr in [
        "#![deny(unsafe_code)]",
        "#![warn(clippy::undocumented_unsafe_blocks)]",
    ] {
        assert!(
            lib.lines().any(|l| l.trim() == attr),
            "probes/src/lib.rs lost {attr}"
        );
    }
    let root = common::repo_root().join("probes/src");
    let mut allows = Vec::new();
    for file in common::rust_files(&root) {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.contains("allow(unsafe_code)") {
                let next = lines.get(i + 1).map_or("", |l| l.trim());
                allows.push(format!("{}: {next}", file.display()));
            }
        }
        let in_verbs = file.starts_with(root.join("rdma/verbs"));
        let has_unsafe = lines
            .iter()
            .any(|l| !l.trim_start().starts_with("//") && l.contains("unsafe {"));
        assert!(
            in_verbs || !has_unsafe,
            "{} has an unsafe block outside probes/src/rdma/verbs/",
            file.display()
        );
    }
    assert_eq!(allows.len(), 1, "{allows:?}");
    assert!(
        allows[0].ends_with("rdma/mod.rs: pub mod verbs;"),
        "{allows:?}"
    );
}

#[test]
fn fallback_does_not_import_metrics() {
    let fallback = read("src/observe/fallback.rs");
    assert!(
        !fallback.contains("crate::observe::metrics"),
        "src/observe/fallback.rs imports metrics again (metrics imports fallback)"
    );
}

/// The floors of `src/`, lowest first, and what each may use besides the probes crate. A folder
/// uses the core and the floors below it, never a sibling's internals; the agent wires the
/// others together (docs/design.md, "Floors").
const FLOORS: &[(&str, &[&str])] = &[
    ("error", &[]),
    ("text", &[]),
    ("config", &["error", "text"]),
    ("policy", &["config", "error", "text"]),
    ("peers", &["config", "error", "text", "policy"]),
    ("observe", &["config", "error", "text", "policy", "peers"]),
    ("checks", &["config", "error", "text", "policy", "observe"]),
    ("node", &["config", "error", "text", "policy", "observe"]),
    (
        "cluster",
        &["config", "error", "text", "policy", "observe", "node"],
    ),
    ("pod", &["config", "error", "text", "policy", "observe"]),
    (
        "cli",
        &[
            "config", "error", "text", "policy", "observe", "checks", "pod",
        ],
    ),
    (
        "harness",
        &[
            "cli", "config", "error", "text", "policy", "observe", "node",
        ],
    ),
    (
        "agent",
        &[
            "cli", "config", "error", "text", "policy", "peers", "observe", "checks", "node",
            "harness",
        ],
    ),
    (
        "command",
        &[
            "cli", "config", "error", "text", "policy", "peers", "observe", "checks", "node",
            "pod", "cluster", "harness", "agent",
        ],
    ),
];

/// Feature folders: the whole of one feature, its own floors inside. Each file (or folder of
/// tests beside it) is on the crate floor its name says, and is checked as a file of that floor;
/// a path into the feature (`crate::transport::verdict`) is a use of the floor of that file.
const FEATURES: &[(&str, &[(&str, &str)])] = &[
    (
        "gang",
        &[
            ("settings", "config"),
            ("fabriccheck", "node"),
            ("ring", "agent"),
            ("admission_check", "cluster"),
        ],
    ),
    (
        "device_plugin",
        &[("assess", "policy"), ("node_checks", "agent")],
    ),
    (
        "dra",
        &[
            ("settings", "config"),
            ("assess", "policy"),
            ("metrics", "observe"),
            ("common", "node"),
            ("slices", "node"),
            ("claims", "node"),
            ("in_pods", "node"),
            ("registration", "node"),
            ("rules", "node"),
            ("jobs", "node"),
        ],
    ),
    (
        "transport",
        &[
            ("settings", "config"),
            ("bandwidth", "policy"),
            ("verdict", "policy"),
            ("eviction", "policy"),
            ("metrics", "observe"),
            ("jobs", "node"),
            ("pods", "node"),
            ("peers", "node"),
            ("writer", "node"),
            ("sampler", "agent"),
            ("task", "agent"),
            ("check", "agent"),
            ("check_peers", "agent"),
        ],
    ),
];

/// The crate floor of `feature::file`, `None` for a name the feature table does not know.
fn feature_floor(feature: &str, file: &str) -> Option<&'static str> {
    FEATURES
        .iter()
        .find(|(f, _)| *f == feature)?
        .1
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, floor)| *floor)
}

/// Rust source with comments, string and character literals blanked out (same length), so
/// that a path in a doc comment or a message is not an import.
pub(crate) fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if b[i] == b'r'
            && (b[i + 1..].starts_with(b"\"") || b[i + 1..].starts_with(b"#"))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // raw string r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while j < b.len() && b[j] == b'#' {
                hashes += 1;
                j += 1;
            }
            if j < b.len() && b[j] == b'"' {
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let end = b[j + 1..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| j + 1 + p + close.len());
                for &c in &b[i..end] {
                    blank(&mut out, c);
                }
                i = end;
            } else {
                out.push(b[i]);
                i += 1;
            }
        } else if b[i] == b'"' {
            blank(&mut out, b[i]);
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
            if i < b.len() {
                out.push(b' ');
                i += 1;
            }
        } else if b[i] == b'\'' && (b[i + 1..].starts_with(b"\\") || b.get(i + 2) == Some(&b'\'')) {
            // a char literal ('x', '\n', '\''), not a lifetime
            let end = if b[i + 1] == b'\\' {
                b[i + 2..]
                    .iter()
                    .position(|&c| c == b'\'')
                    .map_or(b.len(), |p| i + 3 + p)
            } else {
                i + 3
            };
            for &c in &b[i..end.min(b.len())] {
                blank(&mut out, c);
            }
            i = end;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Tokens of code: identifiers, `::`, and single punctuation characters.
pub(crate) fn tokens(code: &str) -> Vec<String> {
    let cs: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '_') {
                i += 1;
            }
            out.push(cs[start..i].iter().collect());
        } else if c == ':' && cs.get(i + 1) == Some(&':') {
            out.push("::".to_owned());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += 1;
        }
    }
    out
}

/// The crate modules a file's code names: every `use` tree rooted at `crate` (groups and
/// nesting expanded) and every inline `crate::x` path.
fn crate_modules_used(text: &str) -> std::collections::BTreeSet<String> {
    let code = code_only(text);
    let tokens = tokens(&code);
    let mut used = std::collections::BTreeSet::new();
    let mut t = 0;
    while t < tokens.len() {
        if tokens[t] == "use" {
            // Collect the tree up to `;` and expand the first segment after `crate::`.
            let end = tokens[t..]
                .iter()
                .position(|x| x == ";")
                .map_or(tokens.len(), |p| t + p);
            expand_use(&tokens[t + 1..end], &mut used, false);
            t = end;
        } else if tokens[t] == "crate"
            && tokens.get(t + 1).is_some_and(|x| x == "::")
            && let Some(m) = tokens.get(t + 2)
            && m != "{"
        {
            match feature_sub(&tokens[t + 2..]) {
                Some(sub) => used.insert(sub),
                None => used.insert(m.clone()),
            };
            t += 3;
        } else {
            t += 1;
        }
    }
    used
}

/// Walk a `use` tree: `crate::a::b`, `crate::{a, b::c}`, `{crate::a, std::x}`.
fn expand_use(tree: &[String], used: &mut std::collections::BTreeSet<String>, in_crate: bool) {
    let mut depth = 0usize;
    let mut start = 0;
    let mut items: Vec<&[String]> = Vec::new();
    // Split a group body at top-level commas.
    let body: &[String] =
        if tree.first().is_some_and(|x| x == "{") && tree.last().is_some_and(|x| x == "}") {
            &tree[1..tree.len() - 1]
        } else {
            tree
        };
    for (k, tok) in body.iter().enumerate() {
        match tok.as_str() {
            "{" => depth += 1,
            "}" => depth = depth.saturating_sub(1),
            "," if depth == 0 => {
                items.push(&body[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    items.push(&body[start..]);
    for item in items {
        if item.is_empty() {
            continue;
        }
        if item[0] == "{" {
            expand_use(item, used, in_crate);
        } else if in_crate {
            used.insert(feature_sub(item).unwrap_or_else(|| item[0].clone()));
        } else if item[0] == "crate" && item.get(1).is_some_and(|x| x == "::") {
            match item.get(2).map(String::as_str) {
                Some("{") => expand_use(&item[2..], used, true),
                Some(m) => {
                    used.insert(feature_sub(&item[2..]).unwrap_or_else(|| m.to_owned()));
                }
                None => {}
            }
        }
    }
}

/// `feature::file` for a path that starts with a feature folder (`transport :: verdict ...`);
/// a group into it (`transport::{verdict::X, pods::Y}`) names the first file only, so the
/// feature's own files name one file per `use`.
fn feature_sub(path: &[String]) -> Option<String> {
    let feature = path.first()?;
    FEATURES.iter().find(|(f, _)| f == feature)?;
    if path.get(1).is_some_and(|x| x == "::")
        && let Some(file) = path.get(2)
        && file != "{"
    {
        return Some(format!("{feature}::{file}"));
    }
    Some(feature.clone())
}

/// The floor a file of `src/` belongs to: its folder, or its own name at the top; in a feature
/// folder, the floor its file's name says (`transport/verdict.rs`, `transport/check/tests.rs`).
fn floor_of(rel: &std::path::Path) -> Option<String> {
    let mut comps = rel.components();
    let first = comps.next()?.as_os_str().to_str()?.to_owned();
    let Some(second) = comps.next() else {
        return Some(first.trim_end_matches(".rs").to_owned());
    };
    if FEATURES.iter().any(|(f, _)| *f == first) {
        let file = second.as_os_str().to_str()?.trim_end_matches(".rs");
        if file == "mod" {
            return Some("lib".to_owned());
        }
        return feature_floor(&first, file).map(str::to_owned);
    }
    Some(first)
}

/// The siblings a file of a feature folder names through `super::` (`use super::pods::X`), as
/// `feature::file`.
fn feature_siblings_used(rel: &std::path::Path, text: &str) -> Vec<String> {
    let Some(feature) = rel.components().next().and_then(|c| c.as_os_str().to_str()) else {
        return Vec::new();
    };
    if !FEATURES.iter().any(|(f, _)| *f == feature) || rel.components().count() != 2 {
        return Vec::new();
    }
    let tokens = tokens(&code_only(text));
    tokens
        .windows(3)
        .filter(|w| w[0] == "super" && w[1] == "::")
        .filter(|w| feature_floor(feature, &w[2]).is_some())
        .map(|w| format!("{feature}::{}", w[2]))
        .collect()
}

#[test]
fn use_paths_parse_groups_nesting_and_ignore_comments_and_strings() {
    let text = r#"
        use crate::config::{Config, NodeSettings};
        use crate::{error::Error, policy::{self, Verdict}};
        use {crate::peers, std::io};
        // use crate::agent;
        /// [`crate::cluster::guard`]
        const S: &str = "crate::node";
        fn f() { let _ = crate::observe::metrics::x(); let c = '"'; let l: &'static str = "a"; }
    "#;
    let got: Vec<String> = crate_modules_used(text).into_iter().collect();
    assert_eq!(got, ["config", "error", "observe", "peers", "policy"]);
}

/// A feature folder's files are on their own floors, and a path into the feature is a use of
/// the floor of the file it names.
#[test]
fn feature_folders_have_floors_by_file() {
    let text = r#"
        use crate::transport::verdict::PodVerdict;
        use crate::{transport::pods::JudgedPod, node::Clients};
        use super::writer::PodWriter;
        fn f() { crate::transport::task::start(); }
    "#;
    let got: Vec<String> = crate_modules_used(text).into_iter().collect();
    assert_eq!(
        got,
        [
            "node",
            "transport::pods",
            "transport::task",
            "transport::verdict"
        ]
    );
    let rel = std::path::Path::new("transport/check.rs");
    assert_eq!(feature_siblings_used(rel, text), ["transport::writer"]);
    for (file, floor) in [
        ("transport/settings.rs", "config"),
        ("transport/verdict.rs", "policy"),
        ("transport/check/tests.rs", "agent"),
        ("transport/mod.rs", "lib"),
        ("node/pods_watch.rs", "node"),
    ] {
        assert_eq!(
            floor_of(std::path::Path::new(file)).as_deref(),
            Some(floor),
            "{file}"
        );
    }
    assert_eq!(floor_of(std::path::Path::new("transport/new.rs")), None);
}

#[test]
fn every_floor_uses_only_the_floors_below_it() {
    let root = common::repo_root().join("src");
    let allowed: std::collections::BTreeMap<&str, &[&str]> = FLOORS.iter().copied().collect();
    let mut wrong = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for file in common::rust_files(&root) {
        let rel = file.strip_prefix(&root).unwrap();
        let Some(floor) = floor_of(rel) else {
            wrong.push(format!("{}: a feature file not in FEATURES", rel.display()));
            continue;
        };
        if floor == "lib" || floor == "main" {
            continue; // the crate root and the CLI dispatch see everything
        }
        let Some(may) = allowed.get(floor.as_str()) else {
            wrong.push(format!("{}: floor {floor} is not in FLOORS", rel.display()));
            continue;
        };
        seen.insert(floor.clone());
        let text = std::fs::read_to_string(&file).unwrap();
        let mut used: Vec<String> = crate_modules_used(&text).into_iter().collect();
        used.extend(feature_siblings_used(rel, &text));
        for m in used {
            let top_level_item =
                m.chars().next().is_some_and(char::is_uppercase) || m.starts_with("EXIT_");
            // A file of a feature folder is a use of its floor.
            let target = match m.split_once("::") {
                Some((feature, file)) => match feature_floor(feature, file) {
                    Some(f) => f.to_owned(),
                    None => {
                        wrong.push(format!(
                            "{} uses crate::{m}, not in FEATURES",
                            rel.display()
                        ));
                        continue;
                    }
                },
                None if FEATURES.iter().any(|(f, _)| *f == m) => {
                    wrong.push(format!(
                        "{} ({floor}) uses crate::{m} without naming its file",
                        rel.display()
                    ));
                    continue;
                }
                None => m.clone(),
            };
            if target == floor || top_level_item || may.contains(&target.as_str()) {
                continue;
            }
            wrong.push(format!("{} ({floor}) uses crate::{m}", rel.display()));
        }
    }
    assert!(wrong.is_empty(), "floors crossed:\n{}", wrong.join("\n"));
    // The table has no stale floors.
    for (floor, _) in FLOORS {
        assert!(
            seen.contains(*floor),
            "FLOORS names {floor}, which src/ no longer has"
        );
    }
}

#[test]
fn the_probes_crate_has_no_kubernetes_and_no_async_runtime() {
    let manifest = read("probes/Cargo.toml");
    for dep in ["kube", "k8s-openapi", "tokio"] {
        assert!(
            !manifest
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{dep} "))
                    || l.trim_start().starts_with(&format!("{dep}="))),
            "probes/Cargo.toml depends on {dep}"
        );
    }
}

#[test]
fn no_source_file_is_over_900_lines() {
    let mut long = Vec::new();
    for dir in ["src", "probes/src"] {
        for file in common::rust_files(&common::repo_root().join(dir)) {
            let n = std::fs::read_to_string(&file).unwrap().lines().count();
            if n > 900 {
                long.push(format!("{}: {n} lines", file.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "split these by responsibility:\n{}",
        long.join("\n")
    );
}

/// Each function of `code` (comments and strings blanked, [`code_only`]) with its first line
/// (1-based) and its length in lines, from `fn` to its closing brace.
fn function_lengths(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(at) = t.find("fn ") else { continue };
        let head = &t[..at];
        let is_fn = head.split_whitespace().all(|w| {
            matches!(w, "pub" | "async" | "const" | "unsafe" | "extern") || w.starts_with("pub(")
        });
        if !is_fn {
            continue;
        }
        let name: String = t[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body: from the first `{` after the signature to its matching `}`; a declaration
        // without a body (`;` first) is no function here.
        let mut depth = 0usize;
        let mut opened = false;
        let mut end = None;
        'scan: for (j, l) in lines.iter().enumerate().skip(i) {
            for c in l.chars() {
                match c {
                    ';' if !opened => break 'scan,
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' if opened => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(j);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(end) = end {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

#[test]
fn function_lengths_count_from_fn_to_its_closing_brace() {
    let code = "fn a() {\n    if x { y }\n}\n\nfn decl();\n\npub(crate) async fn b(\n    x: u8,\n) -> u8 {\n    x\n}\n";
    assert_eq!(
        function_lengths(code),
        [("a".to_owned(), 1, 3), ("b".to_owned(), 7, 5)]
    );
}

#[test]
fn no_function_is_over_120_lines() {
    let mut long = Vec::new();
    for dir in ["src", "probes/src"] {
        for file in common::rust_files(&common::repo_root().join(dir)) {
            let code = code_only(&std::fs::read_to_string(&file).unwrap());
            for (name, line, n) in function_lengths(&code) {
                if n > 120 {
                    long.push(format!("{}:{line}: fn {name}: {n} lines", file.display()));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "split these into steps that each say what they do:\n{}",
        long.join("\n")
    );
}

/// One convention for unit tests: a module `tests` right after `#[cfg(test)]`, inline
/// (`mod tests { .. }`) or in its own file beside the code (`x/tests.rs`, `x/tests/mod.rs`),
/// never a test module under another name or placed by `#[path]`.
#[test]
fn test_modules_follow_one_convention() {
    let mut odd = Vec::new();
    for dir in ["src", "probes/src"] {
        for file in common::rust_files(&common::repo_root().join(dir)) {
            let code = code_only(&std::fs::read_to_string(&file).unwrap());
            let lines: Vec<&str> = code.lines().map(str::trim).collect();
            for (i, line) in lines.iter().enumerate() {
                if *line != "#[cfg(test)]" {
                    continue;
                }
                // The item the attribute is on, past any other attributes.
                let Some(item) = lines[i + 1..].iter().find(|l| !l.starts_with("#[")) else {
                    continue;
                };
                let placed = lines[i + 1..]
                    .iter()
                    .take_while(|l| l.starts_with("#["))
                    .any(|l| l.starts_with("#[path"));
                let module = item
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub ")
                    .strip_prefix("mod ")
                    .map(|rest| rest.trim_end_matches(['{', ';', ' ']));
                match module {
                    Some(name) if name != "tests" || placed => odd.push(format!(
                        "{}:{}: mod {name}{}",
                        file.display(),
                        i + 2,
                        if placed { " (placed by #[path])" } else { "" }
                    )),
                    _ => {}
                }
            }
        }
    }
    assert!(
        odd.is_empty(),
        "name the module `tests`, inline or in tests.rs beside the code:\n{}",
        odd.join("\n")
    );
}
