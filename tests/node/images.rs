//! The images the node runs, imported into its containerd (no registry is reachable):
//! `localhost/pause:3.10` (the sandbox image), `localhost/debian:bookworm` (test pods) and the
//! agent's image, built from the project's Dockerfile by `.ci/image.sh` into
//! `$FABRICGATE_IMAGE_DIR` (default `/opt/fabricgate-image`). The agent image is imported
//! under two tags (`v1`, `v2`: the rolling upgrade), the Debian image once more as the broken
//! agent image (no fabricgate in it: the container cannot start).
//!
//! Under `CI=true` those archives must be there and current (`.ci/image.sh --check`).
//! Elsewhere, when they are missing or stale (sources changed since `.ci/image.sh` ran), a
//! stand-in from `tests/node/images.sh` is used instead and the run says so: its own Debian
//! base with the verbs libraries + this build's `fabricgate`, the Dockerfile's entrypoint and
//! user (cached under `$CARGO_TARGET_TMPDIR/node-images`).

use super::harness::{RealNode, StartError};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const AGENT: &str = "localhost/fabricgate:v1";
/// The same image under a second tag, for the rolling upgrade.
pub const AGENT_NEXT: &str = "localhost/fabricgate:v2";
/// An image whose entrypoint does not exist: the agent container cannot start.
pub const BROKEN: &str = "localhost/fabricgate:broken";

fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

fn image_dir() -> PathBuf {
    std::env::var_os("FABRICGATE_IMAGE_DIR")
        .map_or_else(|| PathBuf::from("/opt/fabricgate-image"), PathBuf::from)
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `.ci/image.sh --check` says every archive is there and built from the current
/// inputs; the reason when not.
fn image_sh_current() -> Result<(), String> {
    let out = Command::new("bash")
        .arg(repo().join(".ci/image.sh"))
        .arg("--check")
        .output()
        .map_err(|e| format!(".ci/image.sh --check: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Builds (the stand-in, when needed) and imports the images; says which agent image runs.
pub fn prepare(node: &RealNode) -> Result<String, StartError> {
    let f = StartError::Failed;
    let dir = image_dir();
    match image_sh_current() {
        Ok(()) => {
            node.import_image(&dir.join("pause.oci.tar"), "localhost/pause:3.10")
                .map_err(f)?;
            node.import_image(&dir.join("debian.oci.tar"), "localhost/debian:bookworm")
                .map_err(f)?;
            node.import_image(&dir.join("debian.oci.tar"), BROKEN)
                .map_err(f)?;
            let agent = dir.join("fabricgate.oci.tar");
            node.import_image(&agent, AGENT).map_err(f)?;
            node.import_image(&agent, AGENT_NEXT).map_err(f)?;
            Ok(format!(
                "the image built from the Dockerfile, {}",
                agent.display()
            ))
        }
        Err(why) if in_ci() => Err(StartError::Missing(format!(
            "the images of .ci/image.sh under CI=true: {why}"
        ))),
        Err(why) => {
            println!("node: not the Dockerfile's image ({why}); using the stand-in");
            standin(node)
        }
    }
}

fn standin(node: &RealNode) -> Result<String, StartError> {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("node-images");
    for tool in ["mmdebstrap", "umoci", "skopeo", "gcc"] {
        let ok = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err(StartError::Missing(format!(
                "`{tool}` for the stand-in images (install with .ci/node.sh)"
            )));
        }
    }
    let script = repo().join("tests/node/images.sh");
    let log = node.logs.join("images.log");
    let o = Command::new("bash")
        .arg(&script)
        .arg(&out)
        .arg(env!("CARGO_BIN_EXE_fabricgate"))
        .output()
        .map_err(|e| StartError::Failed(format!("{}: {e}", script.display())))?;
    let _ = std::fs::write(&log, [o.stdout.as_slice(), o.stderr.as_slice()].concat());
    if !o.status.success() {
        return Err(StartError::Failed(format!(
            "{} failed ({}), see {}",
            script.display(),
            o.status,
            log.display()
        )));
    }
    let f = StartError::Failed;
    node.import_image(&out.join("pause.tar"), "localhost/pause:3.10")
        .map_err(f)?;
    node.import_image(&out.join("bookworm.tar"), "localhost/debian:bookworm")
        .map_err(f)?;
    node.import_image(&out.join("bookworm.tar"), BROKEN)
        .map_err(f)?;
    node.import_image(&out.join("standin.tar"), AGENT)
        .map_err(f)?;
    node.import_image(&out.join("standin.tar"), AGENT_NEXT)
        .map_err(f)?;
    Ok("stand-in image: Debian base + this build's fabricgate".into())
}
