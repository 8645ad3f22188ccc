//! The container images the node tests run (`.ci/image.sh`): built from the current
//! `Dockerfile` and sources, and shaped as the harness and `daemonset.yaml` expect. Under
//! `CI=true` a missing or stale archive fails: if the Dockerfile stops building, image.sh fails
//! the test setup, and this test fails a run that skipped it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;

fn image_dir() -> PathBuf {
    std::env::var_os("FABRICGATE_IMAGE_DIR")
        .map_or_else(|| PathBuf::from("/opt/fabricgate-image"), PathBuf::from)
}

/// One file of an OCI archive (a tar), read with tar(1).
fn archive_file(archive: &Path, member: &str) -> Vec<u8> {
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg(member)
        .output()
        .unwrap_or_else(|e| panic!("tar -xOf {}: {e}", archive.display()));
    assert!(
        out.status.success(),
        "{member} in {}: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn json(bytes: &[u8], what: &str) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

fn blob(archive: &Path, digest: &str) -> serde_json::Value {
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("{}: digest {digest:?} is not sha256", archive.display()));
    json(
        &archive_file(archive, &format!("blobs/sha256/{hex}")),
        &format!("{} blob {digest}", archive.display()),
    )
}

/// The image config (`config` of the OCI config blob) of the image named `name` in `archive`.
fn image_config(archive: &Path, name: &str) -> serde_json::Value {
    let index = json(&archive_file(archive, "index.json"), "index.json");
    let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    let manifest = manifests
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == name)
        .unwrap_or_else(|| {
            panic!(
                "{}: no image named {name} (ctr images import names it from this annotation): {index}",
                archive.display()
            )
        });
    let digest = manifest["digest"].as_str().unwrap_or_default();
    let config_digest = blob(archive, digest)["config"]["digest"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    blob(archive, &config_digest)["config"].clone()
}

#[test]
fn image_archives_match_the_dockerfile_and_sources_and_name_their_images() {
    let script = common::repo_root().join(".ci/image.sh");
    let check = Command::new("bash")
        .arg(&script)
        .arg("--check")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let why = String::from_utf8_lossy(&check.stderr).trim().to_owned();
    if !common::require(
        check.status.success(),
        &format!("the node tests' images are not built from this tree: {why}"),
        "run .ci/image.sh (scripts/setup-tests.sh does)",
    ) {
        return;
    }
    let dir = image_dir();

    let agent = image_config(&dir.join("fabricgate.oci.tar"), "localhost/fabricgate:dev");
    assert_eq!(
        agent["Entrypoint"],
        serde_json::json!(["/usr/local/bin/fabricgate"]),
        "{agent}"
    );
    assert_eq!(agent["Cmd"], serde_json::json!(["run"]), "{agent}");
    assert_eq!(agent["User"], "65532:65532", "{agent}");

    let pause = image_config(&dir.join("pause.oci.tar"), "localhost/pause:3.10");
    assert_eq!(
        pause["Entrypoint"],
        serde_json::json!(["/pause"]),
        "{pause}"
    );
    assert_eq!(pause["User"], "65535:65535", "{pause}");

    let debian = image_config(&dir.join("debian.oci.tar"), "localhost/debian:bookworm");
    assert_eq!(debian["Cmd"], serde_json::json!(["/bin/bash"]), "{debian}");
}
