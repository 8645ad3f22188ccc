//! The test environment: CI or a developer's machine.

/// `CI=true` (CI's `.ci/run` sets it): a missing tool or privilege fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// A missing prerequisite: a failure under CI, a printed `SKIP:` line elsewhere.
pub fn skip_or_fail(why: &str) {
    assert!(!in_ci(), "CI=true but {why}");
    eprintln!("SKIP: {why}");
}
