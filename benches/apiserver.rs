//! Figures measured on the real kube-apiserver (the control plane of the cluster tests,
//! `.ci/controlplane.sh`), printed, not asserted; what must hold is asserted by
//! `cargo test --test cluster`. Not criterion: each figure is one long run (a minute to
//! several), not a loop of short iterations.
//!
//! `cargo bench --profile dev --bench apiserver -- NAME...` (the documented figures are of the
//! debug build), where NAME is
//! - `port_down`: port down → taint at `--interval 1s` over 10 flips (docs/performance.md);
//! - `fleet`: `FABRICGATE_FLEET` agents (default 500) in this process, watch per Node vs
//!   periodic GETs vs watch + breaker (`FABRICGATE_FLEET_MODES`, a comma-separated subset of
//!   `watch,gets,breaker,dra`; `dra`: each agent also watches its ResourceSlices and rules) (docs/scale.md);
//! - `scale`: a pool of `FABRICGATE_SCALE_POOL` GPU-sized Nodes (default 5000) with
//!   `FABRICGATE_SCALE_AGENTS` real agents (default 512), `FABRICGATE_SCALE_LEAF` of them
//!   (default all) failing at once, the breaker on, per `FABRICGATE_SCALE_MODES`
//!   (`summary`: the guard publishes the pool summary; `list`: no guard, the agents list the
//!   pool; `transport`: `FABRICGATE_SCALE_JOBS` running jobs (default 1000) of
//!   `FABRICGATE_SCALE_JOB_PODS` pods (default 8) on the pool and the agents with runtime
//!   transport, what their per-job watches carry; `transport-off`: the same without it),
//!   quiet window `FABRICGATE_SCALE_QUIET_SECS` (default 120) (docs/scale.md);
//! - `guard`: `fabricgate guard` over `FABRICGATE_SCALE_POOL` GPU-sized Nodes (default 5000),
//!   each with a Ready agent pod: its lists, RSS, CPU, agent death -> taint at
//!   `--stale-after 30s`, alone and under a status storm of `FABRICGATE_GUARD_STORM_SECS`
//!   (default 60) (docs/scale.md).
//!
//! Without a NAME it lists them and measures nothing: `cargo bench` alone must not start a
//! 500-agent fleet.

// The integration tests' support module (control plane, Nodes, agents, the fleet).
#[path = "../tests/common/mod.rs"]
mod common;

use common::fleet::{self, report, run_fleet};
use common::guard_scale::{GuardScaleSpec, run_guard_scale};
use common::scale::{ScaleSpec, run_scale};
use common::scale_transport::{TransportScaleSpec, run_transport_scale};
use common::{TestNode, control_plane, env_usize, wait_until};
use std::time::Duration;

const FIGURES: [(&str, fn()); 4] = [
    ("port_down", port_down),
    ("fleet", fleet),
    ("scale", scale),
    ("guard", guard),
];

fn main() {
    // `cargo bench` passes `--bench`; the rest are names.
    let names: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if names.is_empty() {
        let all: Vec<&str> = FIGURES.iter().map(|(n, _)| *n).collect();
        println!(
            "apiserver: nothing measured; name one or more of {all:?} \
             (cargo bench --profile dev --bench apiserver -- port_down)"
        );
        return;
    }
    for name in &names {
        let Some((_, run)) = FIGURES.iter().find(|(n, _)| n == name) else {
            panic!("unknown figure {name:?}");
        };
        run();
    }
}

/// Port down → our taint on the real apiserver's Node at `--interval 1s`, over 10 flips.
fn port_down() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-measure");
    let (hca, agent) = node.run_agent(true, None, &["--interval", "1s"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    let mut took = Vec::new();
    for _ in 0..10 {
        hca.set_port(false);
        took.push(wait_until("taint", Duration::from_secs(5), || {
            node.has_our_taint()
        }));
        hca.set_port(true);
        wait_until("untaint", Duration::from_secs(15), || node.ready());
        // Off the interval's beat, so the flips sample different phases of it.
        std::thread::sleep(Duration::from_millis(137));
    }
    took.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "port down -> taint on kube-apiserver at --interval 1s over {} flips: min {:.0} ms, median {:.0} ms, max {:.0} ms",
        took.len(),
        ms(took[0]),
        ms(took[took.len() / 2]),
        ms(took[took.len() - 1])
    );
}

/// The fleet figures of docs/scale.md.
fn fleet() {
    let Some(cp) = control_plane() else { return };
    let n = env_usize("FABRICGATE_FLEET", 500);
    let quiet = Duration::from_secs(120);
    let modes =
        std::env::var("FABRICGATE_FLEET_MODES").unwrap_or_else(|_| "watch,gets,breaker".to_owned());
    for mode in modes.split(',') {
        let (label, watch, breaker) = match mode.trim() {
            "watch" => ("watch per Node", true, false),
            "gets" => ("periodic GETs (resync 60s)", false, false),
            "breaker" => ("watch per Node + breaker", true, true),
            "dra" => ("watch per Node + DRA slices and rules", true, false),
            other => panic!("FABRICGATE_FLEET_MODES: unknown mode {other:?}"),
        };
        fleet::DRA.store(mode.trim() == "dra", std::sync::atomic::Ordering::Relaxed);
        let f = run_fleet(
            cp,
            &format!("fleet-{}", mode.trim()),
            n,
            watch,
            breaker,
            quiet,
        );
        println!("{}", report(label, &f));
    }
}

/// The 5,000-Node figures of docs/scale.md.
fn scale() {
    let Some(cp) = control_plane() else { return };
    let pool = env_usize("FABRICGATE_SCALE_POOL", 5000);
    let agents = env_usize("FABRICGATE_SCALE_AGENTS", 512).min(pool);
    let leaf = env_usize("FABRICGATE_SCALE_LEAF", agents).min(agents);
    let quiet = Duration::from_secs(env_usize("FABRICGATE_SCALE_QUIET_SECS", 120) as u64);
    let modes = std::env::var("FABRICGATE_SCALE_MODES").unwrap_or_else(|_| "summary".to_owned());
    let _lease = common::guard::shipped_lease();
    for mode in modes.split(',') {
        let guard = match mode.trim() {
            "summary" => true,
            "list" => false,
            transport @ ("transport" | "transport-off") => {
                let spec = TransportScaleSpec {
                    pool,
                    agents,
                    jobs: env_usize("FABRICGATE_SCALE_JOBS", 1000),
                    pods_per_job: env_usize("FABRICGATE_SCALE_JOB_PODS", 8).max(1),
                    namespaces: 20,
                    runtime: transport == "transport",
                    quiet,
                };
                println!(
                    "{}",
                    run_transport_scale(cp, &format!("scale-{transport}"), &spec).report
                );
                continue;
            }
            other => panic!("FABRICGATE_SCALE_MODES: unknown mode {other:?}"),
        };
        let spec = ScaleSpec {
            pool,
            agents,
            leaf,
            guard,
            quiet,
        };
        println!(
            "{}",
            run_scale(cp, &format!("scale-{}", mode.trim()), &spec).report
        );
    }
}

/// The guard's leader over a 5,000-Node pool (docs/scale.md).
fn guard() {
    let Some(cp) = control_plane() else { return };
    let spec = GuardScaleSpec {
        pool: env_usize("FABRICGATE_SCALE_POOL", 5000),
        stale_after: Duration::from_secs(30),
        storm: Duration::from_secs(env_usize("FABRICGATE_GUARD_STORM_SECS", 60) as u64),
        quiet: Duration::from_secs(env_usize("FABRICGATE_SCALE_QUIET_SECS", 60) as u64),
    };
    println!("{}", run_guard_scale(cp, &spec));
}
