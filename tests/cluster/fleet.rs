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
