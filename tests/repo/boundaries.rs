//! The boundaries the compiler holds stay declared: no `unsafe` in the agent crate, `unsafe`
//! in the probes crate only inside the verbs wrapper, and the fallback detector independent
//! of the metrics module. (The compiler enforces the lint attributes; this test keeps anyone
//! from quietly deleting them.)

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
