//! The event-driven probes' metrics: what started each probe, the kernel events received and
//! which event sources listen (docs/events.md). Here, not in `agent::wakeup`, so the metrics
//! registry does not reach up into the agent.

use fabricgate_probes::events::Source;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What started a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// The interval elapsed (or the first probe).
    Interval,
    /// Events arrived: the source of the first, how many were collected, and the first few.
    Event {
        first: Source,
        count: usize,
        details: Vec<String>,
    },
}

impl Trigger {
    /// The `trigger` label of `fabricgate_probe_trigger_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Interval => "interval",
            Self::Event { first, .. } => first.name(),
        }
    }
}

/// The `trigger` label values of `fabricgate_probe_trigger_total`.
pub const TRIGGERS: [&str; 4] = ["interval", "netlink", "uevent", "verbs_async"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: &'static str,
}

/// `fabricgate_probe_trigger_total{trigger}`, `fabricgate_events_total{source}` and
/// `fabricgate_event_source_active{source}`.
#[derive(Debug, Clone, Default)]
pub struct EventMetrics {
    triggers: Family<TriggerLabels, Counter>,
    events: Family<SourceLabels, Counter>,
    active: Family<SourceLabels, Gauge>,
}

impl EventMetrics {
    /// Register the three families, every series present from the start (0).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register(
            "fabricgate_probe_trigger",
            "Probes by what started them: the interval, or the first kernel event (netlink link \
             change, uevent, verbs asynchronous event) of a debounced burst",
            m.triggers.clone(),
        );
        r.register(
            "fabricgate_events",
            "Kernel events received, by source (netlink, uevent, verbs_async); lost ones count once",
            m.events.clone(),
        );
        r.register(
            "fabricgate_event_source_active",
            "1 while the event source listens, 0 when it is off or could not be opened (then only \
             the interval probes; see the agent log)",
            m.active.clone(),
        );
        for trigger in TRIGGERS {
            m.triggers
                .get_or_create(&TriggerLabels { trigger })
                .inc_by(0);
        }
        for s in Source::ALL {
            let l = SourceLabels { source: s.name() };
            m.events.get_or_create(&l).inc_by(0);
            m.active.get_or_create(&l).set(0);
        }
        m
    }

    /// Count one probe under what triggered it (and log an event trigger at debug level).
    pub fn probe_triggered(&self, trigger: &Trigger) {
        if let Trigger::Event {
            first,
            count,
            details,
        } = trigger
        {
            tracing::debug!(
                source = first.name(),
                events = count,
                first_events = ?details,
                "probe triggered by kernel events"
            );
        }
        self.triggers
            .get_or_create(&TriggerLabels {
                trigger: trigger.label(),
            })
            .inc();
    }

    pub(crate) fn received(&self, source: Source) {
        self.events
            .get_or_create(&SourceLabels {
                source: source.name(),
            })
            .inc();
    }

    pub(crate) fn set_active(&self, source: Source, active: bool) {
        self.active
            .get_or_create(&SourceLabels {
                source: source.name(),
            })
            .set(i64::from(active));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_start_at_zero_for_every_trigger_and_source() {
        let mut r = Registry::default();
        let m = EventMetrics::register(&mut r);
        m.probe_triggered(&Trigger::Interval);
        m.received(Source::Uevent);
        m.set_active(Source::Netlink, true);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        for line in [
            "fabricgate_probe_trigger_total{trigger=\"interval\"} 1",
            "fabricgate_probe_trigger_total{trigger=\"verbs_async\"} 0",
            "fabricgate_events_total{source=\"uevent\"} 1",
            "fabricgate_event_source_active{source=\"netlink\"} 1",
            "fabricgate_event_source_active{source=\"verbs_async\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
    }
}
