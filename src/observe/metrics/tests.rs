use super::*;

#[test]
fn event_counters_reach_the_served_exposition_without_the_state_lock() {
    let m = Metrics::new();
    let text = |m: &Metrics| String::from_utf8_lossy(&m.exposition(false)).into_owned();
    assert!(text(&m).contains("fabricgate_probe_trigger_total{trigger=\"interval\"} 0"));
    // Counted by the probe loop, outside the state lock: the next scrape shows it.
    m.events
        .probe_triggered(&crate::observe::events::Trigger::Interval);
    assert!(text(&m).contains("fabricgate_probe_trigger_total{trigger=\"interval\"} 1"));
    m.set_breaker_open(true);
    assert!(text(&m).contains("fabricgate_breaker_open 1"));
}

#[test]
fn breaker_open_is_exported() {
    let m = Metrics::new();
    assert!(m.encode(false).contains("fabricgate_breaker_open 0"));
    m.set_breaker_open(true);
    assert!(m.encode(false).contains("fabricgate_breaker_open 1"));
    m.set_breaker_open(false);
    assert!(m.encode(false).contains("fabricgate_breaker_open 0"));
}
