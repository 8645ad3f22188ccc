//! Running the `fabricgate` binary as the CLI tests do, and reading what it printed.

use serde_json::Value;
use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

/// `fabricgate <args>` with `NODE_NAME` unset: exit code, stdout and stderr.
pub fn fabricgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(args)
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// `fabricgate <args> --sysfs-root R --proc-root R --format json` over an empty tree R (a node
/// with no devices and no mounts): exit code and stdout.
pub fn json_over_an_empty_node(args: &[&str]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let mut all = args.to_vec();
    all.extend([
        "--sysfs-root",
        root,
        "--proc-root",
        root,
        "--format",
        "json",
    ]);
    let (code, stdout, _) = fabricgate(&all);
    (code, stdout)
}

/// The flags of `check --verbs off --format json` over `sys` and `proc`, with the config file
/// `config`.
pub fn check_json_args<'a>(sys: &'a Path, proc: &'a Path, config: &'a Path) -> [&'a OsStr; 11] {
    [
        OsStr::new("check"),
        OsStr::new("--verbs"),
        OsStr::new("off"),
        OsStr::new("--format"),
        OsStr::new("json"),
        OsStr::new("--sysfs-root"),
        sys.as_os_str(),
        OsStr::new("--proc-root"),
        proc.as_os_str(),
        OsStr::new("--config"),
        config.as_os_str(),
    ]
}

/// The JSON report on the stdout of `out`; a test failure showing stdout and stderr when it is
/// not JSON.
pub fn stdout_json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): stdout={} stderr={}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Port `port` of RDMA device `device` in a `check --format json` report.
pub fn report_port<'a>(json: &'a Value, device: &str, port: u64) -> &'a Value {
    json["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == device)
        .unwrap_or_else(|| panic!("no device {device}: {json:#}"))["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == port)
        .unwrap()
}
