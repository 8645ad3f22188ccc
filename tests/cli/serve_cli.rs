//! The long-running subcommands share one harness (`src/harness.rs`): an address that cannot
//! be bound is a usage error (exit 2) naming the flag and the address, before anything reaches
//! a cluster; the admission check's old flag name is still read and the error names the new.

use std::net::TcpListener;
use std::process::Command;

/// `fabricgate ARGS`, with no cluster configuration in reach; (exit code, stderr).
fn run(args: &[&str]) -> (Option<i32>, String) {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(args)
        .env("HOME", home.path())
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_long_running_subcommand_names_the_address_it_cannot_bind() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("requirements.yaml");
    std::fs::write(
        &config,
        "node:\n  pool_selector: nvidia.com/gpu.present=true\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let cert = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "run",
                "--node-name",
                "gpu-a",
                "--dry-run",
                "--verbs",
                "off",
                "--metrics-addr",
                &addr,
            ],
            "--metrics-addr",
        ),
        (
            vec!["guard", "--config", config, "--metrics-addr", &addr],
            "--metrics-addr",
        ),
        (
            vec!["admission-check", "--metrics-addr", &addr],
            "--metrics-addr",
        ),
        // The old name, still read (hidden), answered under the one name.
        (
            vec!["admission-check", "--metrics-listen", &addr],
            "--metrics-addr",
        ),
        (
            vec![
                "webhook",
                "--listen",
                &addr,
                "--tls-cert-file",
                cert.to_str().unwrap(),
                "--tls-key-file",
                key.to_str().unwrap(),
                "--preflight-image",
                "registry.example.com/fabricgate:1",
            ],
            "--listen",
        ),
    ];
    for (args, flag) in cases {
        let (code, stderr) = run(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("fabricgate: {flag}: cannot listen on {addr}")),
            "{args:?}: {stderr}"
        );
    }
    drop(taken);
}
