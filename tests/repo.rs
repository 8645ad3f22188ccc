//! What the repository itself must keep: declared boundaries, docs that resolve, the
//! deployment manifests and the reproducible fixture trees.

mod common;

#[path = "repo/boundaries.rs"]
mod boundaries;
#[path = "repo/cycles.rs"]
mod cycles;
#[path = "repo/deploy_manifest.rs"]
mod deploy_manifest;
#[path = "repo/docs.rs"]
mod docs;
#[path = "repo/fixtures_reproducible.rs"]
mod fixtures_reproducible;
#[path = "repo/image.rs"]
mod image;
#[path = "repo/issue_numbers.rs"]
mod issue_numbers;
