//! Property tests of the requirements-file parser: whatever the text, `Config::parse` returns
//! (never panics), quickly, and every error is a usage error (exit 2).

use fabricgate::config::{Config, MAX_CONFIG_DEPTH, nesting_depth};
use proptest::prelude::*;
use std::time::{Duration, Instant};

/// Fragments of the real grammar, so random documents reach the value checks, not only the
/// YAML syntax errors.
fn yamlish() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "rdma",
        "lustre",
        "node",
        "fallback",
        "mounts",
        "devices",
        "selftest",
        "selftest_timeout",
        "statfs_timeout",
        "window",
        "min_rate_gbps",
        "min_active_ports",
        "on_agent_error",
        "label_prefix",
        "recover_after",
        "path",
        "fstype",
        "netdevs",
    ]);
    let value = prop::sample::select(vec![
        "1ns",
        "0s",
        "300000000000y",
        "5s",
        "10m",
        "-1",
        "1e308",
        "NaN",
        "mlx5_*",
        "mlx5_[",
        "every 0 probes",
        "every 3 probes",
        "keep",
        "taint",
        "\"\"",
        "[",
        "]",
        "{",
        "}",
        "~",
        "&a x",
        "*a",
        "!!binary aGk=",
        "'it''s'",
        "\"\\u0000\"",
        "- ",
        "true",
    ]);
    prop::collection::vec((0usize..6, key, value, any::<bool>()), 0..24).prop_map(|lines| {
        lines
            .into_iter()
            .map(|(indent, k, v, seq)| {
                format!(
                    "{}{}{k}: {v}\n",
                    "  ".repeat(indent),
                    if seq { "- " } else { "" }
                )
            })
            .collect()
    })
}

fn check(text: &str) {
    let started = Instant::now();
    if let Err(e) = Config::parse(text) {
        assert_eq!(e.exit_code(), fabricgate::EXIT_USAGE, "{e}");
        assert!(!e.to_string().is_empty());
    }
    // Generous (shared CI machines); the inputs are small and the checks linear.
    assert!(started.elapsed() < Duration::from_secs(5), "{text:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn any_text_is_parsed_or_refused_without_panicking(text in any::<String>()) {
        check(&text);
    }

    #[test]
    fn any_requirements_like_document_is_parsed_or_refused(text in yamlish()) {
        check(&text);
    }

    #[test]
    fn deep_flow_nesting_is_always_refused(depth in (MAX_CONFIG_DEPTH + 1)..5_000usize) {
        let text = format!("rdma: {}{}\n", "[".repeat(depth), "]".repeat(depth));
        prop_assert!(nesting_depth(&text) > MAX_CONFIG_DEPTH);
        let e = Config::parse(&text).unwrap_err().to_string();
        prop_assert!(e.contains("nested"), "{}", e);
    }

    #[test]
    fn any_duration_text_is_bounded_or_refused(n in any::<u64>(), unit in prop::sample::select(vec!["ns", "ms", "s", "m", "h", "d", "y"])) {
        let text = format!("lustre:\n  statfs_timeout: {n}{unit}\n");
        match Config::parse(&text) {
            Ok(c) => prop_assert!(
                c.lustre.statfs_timeout >= Duration::from_millis(10)
                    && c.lustre.statfs_timeout <= Duration::from_secs(600)
            ),
            Err(e) => prop_assert!(e.to_string().contains("lustre.statfs_timeout"), "{}", e),
        }
    }
}
