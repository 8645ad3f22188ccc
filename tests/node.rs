//! fabricgate on a real Kubernetes node: containerd + runc, a kubelet v1.37.x, a real device
//! plugin, a DRA kubelet plugin in DraNet's format (`tests/node/dra.rs`), its own control
//! plane (`tests/node/harness.rs`), and the shipped manifests applied for real
//! (`tests/node/deploy.rs`). One node for the whole binary; the scenarios run in
//! order (each leaves the node healthy for the next), then the teardown, which must leave no
//! process, mount or cgroup behind.
//!
//! `cargo test --test node` runs them all; `cargo test --test node -- plugin` only those whose
//! name contains `plugin` (the node comes up and the agent is deployed either way).
//! Without a piece (root, containerd, the control plane binary, the images) it prints `SKIP:`
//! and passes, except under `CI=true`, where that is a failure. Logs of a failed run stay in
//! `$CARGO_TARGET_TMPDIR/realnode/run-PID/logs`.

#[path = "node/deploy.rs"]
mod deploy;
#[path = "node/dra.rs"]
mod dra;
#[path = "node/dra_agent.rs"]
mod dra_agent;
#[path = "node/dra_scenarios.rs"]
mod dra_scenarios;
#[path = "node/harness.rs"]
mod harness;
#[path = "node/helm.rs"]
mod helm;
#[path = "node/images.rs"]
mod images;
#[path = "node/runtime_transport.rs"]
mod runtime_transport;
#[path = "node/scenarios.rs"]
mod scenarios;

use harness::{RealNode, StartError};
use std::time::Instant;

fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

fn main() {
    // libtest's arguments: filters, `--skip NAME`; other flags (and the values of those that
    // take one) are accepted and ignored.
    let mut filters = Vec::new();
    let mut skips = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--skip" => skips.extend(args.next()),
            "--test-threads" | "--format" | "--color" | "--logfile" | "-Z" => {
                args.next();
            }
            _ if a.starts_with('-') => {}
            _ => filters.push(a),
        }
    }
    // `cargo test` passes libtest flags (--nocapture, --list ...): ignore them, but answer
    // --list with the scenario names.
    if std::env::args().any(|a| a == "--list") {
        for (name, _) in scenarios::ALL {
            println!("{name}: test");
        }
        return;
    }
    // scripts/test.sh runs this binary beside `cargo test --workspace` and says so here, with
    // the file its output goes to: its turn in the sequence has nothing left to do.
    if let Some(log) = std::env::var_os("FABRICGATE_NODE_BESIDE") {
        println!(
            "node: running beside this run (scripts/test.sh), its output in {}",
            std::path::Path::new(&log).display()
        );
        return;
    }
    let chosen: Vec<_> = scenarios::ALL
        .iter()
        .filter(|(name, _)| {
            (filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
                && !skips.iter().any(|s| name.contains(s.as_str()))
        })
        .collect();
    if chosen.is_empty() {
        println!("no node scenario matches {filters:?}");
        return;
    }
    let started = Instant::now();
    let mut node = match RealNode::start("realnode-1") {
        Ok(node) => node,
        Err(StartError::Missing(what)) if !in_ci() => {
            println!("SKIP: node: {what}");
            return;
        }
        Err(StartError::Missing(what)) => {
            eprintln!("FAILED: node: missing under CI=true: {what}");
            std::process::exit(1);
        }
        Err(StartError::Failed(e)) => {
            eprintln!("FAILED: node: the real node did not start: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "node: Ready with the device plugin in {:?}",
        started.elapsed()
    );
    let mut failures = Vec::new();
    let setup = match scenarios::deploy_agent(&node) {
        Ok(image) => Some(image),
        Err(StartError::Missing(what)) if !in_ci() => {
            println!("SKIP: node: {what}");
            None
        }
        Err(StartError::Missing(what)) => {
            failures.push(format!("deploy: missing under CI=true: {what}"));
            None
        }
        Err(StartError::Failed(e)) => {
            failures.push(format!("deploy: {e}"));
            None
        }
    };
    if let Some(image) = setup {
        println!("node: agent validated the node ({image})");
        for (name, run) in chosen {
            let t = Instant::now();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&node)))
                .unwrap_or_else(|p| {
                    Err(p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_else(|| "panicked".into()))
                });
            match result {
                Ok(()) => println!("test {name} ... ok ({:?})", t.elapsed()),
                Err(e) => {
                    println!("test {name} ... FAILED ({:?})", t.elapsed());
                    failures.push(format!("{name}: {e}"));
                }
            }
        }
    }
    let left = node.teardown();
    if left.is_empty() {
        println!("test teardown_leaves_no_process_mount_or_cgroup ... ok");
    } else {
        println!("test teardown_leaves_no_process_mount_or_cgroup ... FAILED");
        failures.push(format!("teardown left: {left:#?}"));
    }
    if failures.is_empty() {
        let _ = std::fs::remove_dir_all(&node.dir);
        println!("node: all passed in {:?}", started.elapsed());
    } else {
        for f in &failures {
            eprintln!("---- {f}");
        }
        eprintln!("node: logs kept in {}", node.logs.display());
        std::process::exit(1);
    }
}
