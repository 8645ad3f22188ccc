//! The images the node runs, imported into its containerd (no registry is reachable):
//! `localhost/pause:3.10` (the sandbox image), `localhost/debian:bookworm` and the agent's
//! image, all from `tests/node/images.sh` (cached under `$CARGO_TARGET_TMPDIR/node-images`).
//!
//! The agent image is the one built from the project's Dockerfile when
//! `FABRICGATE_IMAGE_ARCHIVE` names its OCI archive (`.ci/image.sh`); otherwise a stand-in
//! (the Debian base + this build's `fabricgate` binary, same entrypoint and user). Under
//! `CI=true` the Dockerfile image is required.

use super::harness::{RealNode, StartError};
use std::path::PathBuf;
use std::process::Command;

pub const AGENT: &str = "localhost/fabricgate:v1";
/// The same image under a second tag, for the rolling upgrade.
pub const AGENT_NEXT: &str = "localhost/fabricgate:v2";
/// An image whose entrypoint does not exist: the agent container cannot start.
pub const BROKEN: &str = "localhost/fabricgate:broken";

fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// Builds (cached) and imports the images; returns a description of the agent image.
pub fn prepare(node: &RealNode) -> Result<String, StartError> {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("node-images");
    for tool in ["mmdebstrap", "umoci", "skopeo", "gcc"] {
        let ok = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err(StartError::Missing(format!(
                "`{tool}` for the node's images (install with .ci/node.sh)"
            )));
        }
    }
    let real = std::env::var_os("FABRICGATE_IMAGE_ARCHIVE").map(PathBuf::from);
    if real.is_none() && in_ci() {
        return Err(StartError::Missing(
            "FABRICGATE_IMAGE_ARCHIVE: the agent image built from the Dockerfile (.ci/image.sh)"
                .into(),
        ));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/node/images.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg(&out);
    if real.is_none() {
        cmd.arg(env!("CARGO_BIN_EXE_fabricgate"));
    }
    let log = node.logs.join("images.log");
    let o = cmd
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
    let (archive, what) = match &real {
        Some(p) => (
            p.clone(),
            format!("image built from the Dockerfile, {}", p.display()),
        ),
        None => (
            out.join("standin.tar"),
            "stand-in image: Debian base + this build's fabricgate".to_owned(),
        ),
    };
    node.import_image(&archive, AGENT).map_err(f)?;
    node.import_image(&archive, AGENT_NEXT).map_err(f)?;
    Ok(what)
}
