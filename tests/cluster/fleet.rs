//! A fleet of agents on the real apiserver (`common::fleet`): the small fleet runs in the
//! suite; `FABRICGATE_FLEET=500 cargo bench --profile dev --bench apiserver -- fleet` gives
//! the figures of docs/scale.md.

use crate::common::control_plane;
use crate::common::fleet::{report, run_fleet};
use std::time::Duration;

/// Twenty agents in one process: all validated, no writes at steady state, a correlated
/// failure of two of them tainted within a few intervals.
#[test]
fn twenty_agents_in_one_process_validate_stay_quiet_and_taint_a_failed_tenth() {
    let Some(cp) = control_plane() else { return };
    let f = run_fleet(cp, "fleet-small", 20, true, false, Duration::from_secs(10));
    eprintln!("{}", report("watch", &f));
    assert_eq!(f.writes, 0, "no writes at steady state");
    assert_eq!(
        f.requests, 0,
        "with a watch per Node, no requests at all in 10 s"
    );
    assert!(
        f.failure_to_all_tainted < Duration::from_secs(10),
        "{:?}",
        f.failure_to_all_tainted
    );
}

/// Small: a pool of 200 GPU-sized Nodes, 24 agents, 8 of them failing at once with
/// the shipped breaker (20 new per window) and the guard publishing the pool summary. Every
/// failing node is decided from the guard's Lease and the ledger: no pool list, 3 such
/// requests per failing node (Lease, ledger read, ledger compare-and-swap; a conflict costs
/// one more round), at most 5 on average, and no write at steady state. `benches/apiserver.rs -- scale` runs the
/// same at 5,000 Nodes.
#[test]
fn a_failing_leaf_is_decided_from_the_guards_summary_without_a_pool_list() {
    use crate::common::scale::{ScaleSpec, run_scale};
    let Some(cp) = control_plane() else { return };
    let _lease = crate::common::guard::shipped_lease();
    let spec = ScaleSpec {
        pool: 200,
        agents: 24,
        leaf: 8,
        guard: true,
        quiet: Duration::from_secs(5),
    };
    let run = run_scale(cp, "scale-small", &spec);
    eprintln!("{}", run.report);
    assert_eq!((run.tainted, run.held), (8, 0), "{}", run.report);
    assert_eq!(run.pool_lists, 0, "{}", run.report);
    assert!(
        (8..=8 * 5).contains(&run.decide_requests),
        "{} deciding requests for 8 failing nodes: {}",
        run.decide_requests,
        run.report
    );
    assert_eq!(run.steady_writes, 0, "{}", run.report);
}

/// Runtime transport's watches, small: 200 Nodes, 50 running jobs of 8 pods (two pods on each
/// Node), 16 agents with `runtime.enabled`. Each agent watches its node's pods and, for each
/// job with a pod there, that job's pods by its label in its namespace: exactly the jobs the
/// placement puts on its node, nothing cluster-wide; none asks anything at steady state.
/// `benches/apiserver.rs -- scale` (`FABRICGATE_SCALE_MODES=transport`) runs the same at
/// 5,000 Nodes with what the watches carry.
#[test]
fn runtime_transport_agents_watch_the_pods_of_their_jobs_not_of_the_cluster() {
    use crate::common::scale_transport::{TransportScaleSpec, run_transport_scale};
    let Some(cp) = control_plane() else { return };
    let spec = TransportScaleSpec {
        pool: 200,
        agents: 16,
        jobs: 50,
        pods_per_job: 8,
        namespaces: 4,
        runtime: true,
        quiet: Duration::from_secs(5),
    };
    let run = run_transport_scale(cp, "transport-small", &spec);
    eprintln!("{}", run.report);
    assert_eq!(run.node_watches, 16, "{}", run.report);
    // Two jobs per agent here: a pod of job i/8 and one of job 25 + i/8 on Node i.
    assert_eq!(run.expected_job_watches, 32);
    assert_eq!(
        run.job_selectors, run.expected_job_selectors,
        "{}",
        run.report
    );
    assert_eq!(run.other_pod_watches, 0, "{}", run.report);
    assert_eq!(run.quiet_requests, 0, "{}", run.report);
}
