//! Event-driven probes: the probe loop waits for "the interval elapsed OR the kernel said
//! something changed" (docs/events.md).
//!
//! A thread of its own (`fabricgate-events`) blocks in
//! [`fabricgate_probes::events::EventSources::wait`] and hands what it reads to the probe
//! loop, which calls [`Wakeup::wait`] where it used to sleep. The first event starts a
//! debounce (`events.debounce`, collecting what else arrives), and event-triggered probes are
//! at least `events.min_interval` apart, so a storm of link flaps costs at most one probe per
//! `min_interval`. The interval stays the safety net: a source that cannot be opened is
//! logged once and shown by `fabricgate_event_source_active`, never an agent failure.

use crate::config::events::EventsSettings;
use crate::observe::events::EventMetrics;
pub use crate::observe::events::Trigger;
use fabricgate_probes::events::{Event, EventOptions, EventSources, Source, SourceStatus, Waker};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

/// How long the event thread blocks before it checks whether the agent still wants it, when
/// no eventfd can wake it (see [`Waker`]).
const THREAD_POLL: Duration = Duration::from_secs(1);
/// How long it blocks when the [`Waker`] can end the wait: a wake-up per second of an idle
/// agent costs more than the probe loop at a 10 s interval.
const THREAD_IDLE_WAIT: Duration = Duration::from_secs(30);
/// Event descriptions kept per probe (for the debug log); the count is exact regardless.
const KEEP_DETAILS: usize = 8;

/// When an event-triggered probe may run: `debounce` after the first event of a burst, and
/// at least `min_interval` after the previous event-triggered probe. Pure (times are passed
/// in), so the tests drive it with made-up instants.
#[derive(Debug, Clone)]
pub struct Debounce {
    debounce: Duration,
    min_interval: Duration,
    last: Option<Instant>,
}

impl Debounce {
    pub fn new(debounce: Duration, min_interval: Duration) -> Self {
        Self {
            debounce,
            min_interval,
            last: None,
        }
    }

    /// The probe for a burst whose first event was seen at `first`.
    pub fn due(&self, first: Instant) -> Instant {
        let settled = first + self.debounce;
        match self.last {
            Some(last) => settled.max(last + self.min_interval),
            None => settled,
        }
    }

    /// An event-triggered probe started at `at`.
    pub fn probed(&mut self, at: Instant) {
        self.last = Some(at);
    }
}

/// Events handed from the event thread to the probe loop.
#[derive(Debug, Default)]
struct Pending {
    first: Option<Source>,
    count: usize,
    details: Vec<String>,
}

#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    notify: Notify,
    /// Set when the [`Wakeup`] is dropped; the thread ends at once if the [`Waker`] works,
    /// else within [`THREAD_POLL`].
    closed: AtomicBool,
    waker: Waker,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push<'a>(&self, events: impl IntoIterator<Item = &'a Event>) {
        let mut p = self.lock();
        let mut any = false;
        for e in events {
            any = true;
            p.first.get_or_insert(e.source());
            p.count += 1;
            if p.details.len() < KEEP_DETAILS {
                p.details.push(e.to_string());
            }
        }
        drop(p);
        if any {
            self.notify.notify_one();
        }
    }

    fn has_pending(&self) -> bool {
        self.lock().count > 0
    }

    fn take(&self) -> Pending {
        std::mem::take(&mut *self.lock())
    }
}

/// The probe loop's side: [`Wakeup::wait`] where it used to sleep until the next tick.
#[derive(Debug)]
pub struct Wakeup {
    shared: Arc<Shared>,
    debounce: Debounce,
    /// When the current burst's first event was seen by the probe loop.
    first_seen: Option<Instant>,
}

impl Drop for Wakeup {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Relaxed);
        self.shared.waker.wake();
    }
}

impl Wakeup {
    /// Start the event thread (unless `settings.enabled` is false). Sources that cannot be
    /// opened are logged once (warning) and shown as inactive in `metrics`.
    pub fn start(settings: &EventsSettings, options: EventOptions, metrics: EventMetrics) -> Self {
        let this = Self::new(settings);
        if !settings.enabled {
            tracing::info!(
                "events.enabled is false: ports are probed on the interval only \
                 (no rtnetlink, uevent or verbs event listening)"
            );
            return this;
        }
        let shared = Arc::clone(&this.shared);
        let spawned = std::thread::Builder::new()
            .name("fabricgate-events".into())
            .spawn(move || event_thread(options, &shared, &metrics));
        if let Err(e) = spawned {
            tracing::warn!(
                error = %e,
                "cannot start the event thread; ports are probed on the interval only"
            );
        }
        this
    }

    /// A wakeup that only ever waits for the interval, plus whatever is [`Self::inject`]ed.
    pub fn new(settings: &EventsSettings) -> Self {
        Self {
            shared: Arc::default(),
            debounce: Debounce::new(settings.debounce, settings.min_interval),
            first_seen: None,
        }
    }

    /// Hand events to the loop as the event thread does (tests, and callers with their own
    /// sources).
    pub fn inject(&self, events: &[Event]) {
        self.shared.push(events);
    }

    /// Wait until `tick` (an interval probe) or until events call for a probe (debounced,
    /// and not sooner than `events.min_interval` after the previous event-triggered one).
    /// Events that arrive while a probe runs are kept for the next call. Cancel-safe.
    pub async fn wait(&mut self, tick: Instant) -> Trigger {
        let first = loop {
            if let Some(t) = self.first_seen {
                break t;
            }
            if self.shared.has_pending() {
                break *self.first_seen.insert(Instant::now());
            }
            tokio::select! {
                () = sleep_until(tick) => {
                    return Trigger::Interval;
                }
                () = self.shared.notify.notified() => {}
            }
        };
        let due = self.debounce.due(first);
        if due >= tick {
            // The interval probe comes first and sees whatever the events announced.
            sleep_until(tick).await;
            self.first_seen = None;
            self.shared.take();
            return Trigger::Interval;
        }
        sleep_until(due).await;
        self.first_seen = None;
        self.debounce.probed(Instant::now());
        let p = self.shared.take();
        match p.first {
            Some(first) => Trigger::Event {
                first,
                count: p.count,
                details: p.details,
            },
            // Taken by nobody else: cannot happen, but an interval probe is always right.
            None => Trigger::Interval,
        }
    }
}

/// Fail fast on an event: patch the ports' fresh `state` and `phys_state`
/// ([`fabricgate_probes::Prober::port_states`], two reads per port) into the last full probe's
/// report, for [`crate::policy::judge::Judge::port_event`]. A port that is down now needs
/// nothing else to be judged, so that verdict can go to the Node writer before the full probe
/// (which under emulation takes a second) has finished. `false` when no port's state changed.
pub fn patch_port_states(
    last: &mut fabricgate_probes::ProbeReport,
    states: &[fabricgate_probes::rdma::sysfs::PortStateRead],
) -> bool {
    let mut changed = false;
    for s in states {
        let Some(port) = last
            .rdma
            .devices
            .iter_mut()
            .find(|d| d.name == s.device)
            .and_then(|d| d.ports.iter_mut().find(|p| p.port == s.port))
        else {
            continue;
        };
        if port.state != Some(s.state) {
            port.state = Some(s.state);
            changed = true;
        }
        if s.phys_state.is_some() && port.phys_state != s.phys_state {
            port.phys_state = s.phys_state;
            changed = true;
        }
    }
    changed
}

/// The event thread: open the sources, then hand over what they read until the [`Wakeup`]
/// is dropped.
fn event_thread(options: EventOptions, shared: &Shared, metrics: &EventMetrics) {
    let mut sources = EventSources::open(options);
    sources.set_waker(&shared.waker);
    let timeout = if shared.waker.works() {
        THREAD_IDLE_WAIT
    } else {
        THREAD_POLL
    };
    let mut last: Option<[SourceStatus; 3]> = None;
    report_status(&sources, &mut last, metrics);
    while !shared.closed.load(Ordering::Relaxed) {
        let events = sources.wait(timeout);
        for e in &events {
            metrics.received(e.source());
            tracing::debug!(source = e.source().name(), event = %e, "kernel event");
        }
        shared.push(&events);
        report_status(&sources, &mut last, metrics);
    }
}

/// Set the gauges and log each source's change of state once.
fn report_status(
    sources: &EventSources,
    last: &mut Option<[SourceStatus; 3]>,
    metrics: &EventMetrics,
) {
    let now = sources.status();
    for (i, s) in now.iter().enumerate() {
        metrics.set_active(s.source, s.active);
        let before = last.as_ref().map(|l| &l[i]);
        if before == Some(s) {
            continue;
        }
        let name = s.source.name();
        match (&s.problem, s.active) {
            (Some(problem), _) => tracing::warn!(
                source = name,
                active = s.active,
                problem = %problem,
                "event source degraded: detection through it falls back to the probe interval"
            ),
            (None, true) => {
                let devices = if s.source == Source::VerbsAsync {
                    sources.verbs_devices().join(",")
                } else {
                    String::new()
                };
                tracing::info!(source = name, devices, "event source listening");
            }
            (None, false) if before.is_some_and(|b| b.active) => {
                tracing::info!(
                    source = name,
                    "event source stopped (no device to listen to)"
                );
            }
            (None, false) => {}
        }
    }
    *last = Some(now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::events::LinkChange;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn link_down(name: &str) -> Event {
        Event::Link(LinkChange {
            ifindex: 2,
            name: Some(name.into()),
            deleted: false,
            up: false,
            carrier: false,
            operstate: Some("DOWN"),
        })
    }

    #[test]
    fn debounce_waits_after_the_first_event_and_keeps_probes_apart() {
        let t0 = Instant::now();
        let mut d = Debounce::new(ms(30), ms(100));
        // First burst: debounce only.
        assert_eq!(d.due(t0), t0 + ms(30));
        d.probed(t0 + ms(30));
        // A burst 10 ms after that probe: held until 100 ms after it.
        assert_eq!(d.due(t0 + ms(40)), t0 + ms(130));
        // A burst long after: debounce only again.
        assert_eq!(d.due(t0 + ms(500)), t0 + ms(530));
        // Zero debounce: at once, still floored.
        let mut z = Debounce::new(Duration::ZERO, ms(100));
        assert_eq!(z.due(t0), t0);
        z.probed(t0);
        assert_eq!(z.due(t0 + ms(1)), t0 + ms(100));
    }

    #[tokio::test(start_paused = true)]
    async fn no_event_waits_for_the_tick() {
        let mut w = Wakeup::new(&EventsSettings::default());
        let start = Instant::now();
        let t = w.wait(start + Duration::from_secs(30)).await;
        assert_eq!(t, Trigger::Interval);
        assert_eq!(start.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_probes_after_the_debounce_not_at_the_tick() {
        let mut w = Wakeup::new(&EventsSettings::default());
        let start = Instant::now();
        let tick = start + Duration::from_secs(30);
        let injector = Arc::clone(&w.shared);
        tokio::spawn(async move {
            tokio::time::sleep(ms(5_000)).await;
            injector.push(&[link_down("eth0")]);
            tokio::time::sleep(ms(10)).await;
            injector.push(&[link_down("eth0"), link_down("eth1")]);
        });
        let t = w.wait(tick).await;
        // 5 s to the first event, 30 ms of debounce; the later ones are in the same probe.
        assert_eq!(start.elapsed(), ms(5_030));
        match t {
            Trigger::Event {
                first,
                count,
                details,
            } => {
                assert_eq!(first, Source::Netlink);
                assert_eq!(count, 3);
                assert!(details[0].contains("eth0"), "{details:?}");
            }
            Trigger::Interval => panic!("expected an event trigger"),
        }
        assert_eq!(
            Trigger::Event {
                first: Source::VerbsAsync,
                count: 1,
                details: vec![]
            }
            .label(),
            "verbs_async"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_storm_probes_at_most_once_per_min_interval() {
        let mut w = Wakeup::new(&EventsSettings::default());
        let start = Instant::now();
        let tick = start + Duration::from_secs(30);
        let injector = Arc::clone(&w.shared);
        // An event every millisecond for two seconds.
        tokio::spawn(async move {
            for _ in 0..2_000 {
                injector.push(&[link_down("eth0")]);
                tokio::time::sleep(ms(1)).await;
            }
        });
        let mut probes = Vec::new();
        while start.elapsed() < Duration::from_secs(2) {
            assert!(matches!(w.wait(tick).await, Trigger::Event { .. }));
            probes.push(start.elapsed());
        }
        // 30 ms for the first, then one per 100 ms.
        assert_eq!(probes[0], ms(30));
        for pair in probes.windows(2) {
            assert!(pair[1] - pair[0] >= ms(100), "{probes:?}");
        }
        assert!(
            probes.len() <= 21,
            "{} probes in 2 s: {probes:?}",
            probes.len()
        );
        assert!(
            probes.len() >= 19,
            "{} probes in 2 s: {probes:?}",
            probes.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn events_just_before_the_tick_ride_on_the_interval_probe() {
        let mut w = Wakeup::new(&EventsSettings::default());
        let start = Instant::now();
        let tick = start + ms(1_000);
        w.inject(&[link_down("eth0")]);
        // Pending before the wait: the debounce starts now, and ends before the tick.
        assert!(matches!(
            w.wait(tick).await,
            Trigger::Event { count: 1, .. }
        ));
        assert_eq!(start.elapsed(), ms(30));
        // An event 10 ms before the tick: the tick's probe covers it.
        let tick = start + ms(2_000);
        tokio::time::sleep_until(tick - ms(10)).await;
        w.inject(&[link_down("eth0")]);
        assert_eq!(w.wait(tick).await, Trigger::Interval);
        assert_eq!(start.elapsed(), ms(2_000));
        // ...and is not probed a second time.
        let t = w.wait(start + ms(3_000)).await;
        assert_eq!(t, Trigger::Interval);
        assert_eq!(start.elapsed(), ms(3_000));
    }

    /// The committed 8 x NDR fixture, probed from sysfs, and its requirements.
    fn ndr_node() -> (fabricgate_probes::ProbeReport, crate::config::Config) {
        use fabricgate_probes::{ProbeConfig, Prober, Roots, rdma::VerbsMode};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let node = dir.join("ndr-8x400-healthy");
        let config = crate::config::Config::load(&dir.join("requirements-ndr.yaml")).unwrap();
        let mut prober = Prober::new(
            Roots::new(node.join("sys"), node.join("proc")),
            ProbeConfig {
                verbs: VerbsMode::Off,
                ..ProbeConfig::default()
            },
        );
        (prober.probe(), config)
    }

    fn read(device: &str, state: PortState, phys: Option<PhysState>) -> PortStateRead {
        PortStateRead {
            device: device.into(),
            port: 1,
            state,
            phys_state: phys,
        }
    }

    use fabricgate_probes::rdma::sysfs::PortStateRead;
    use fabricgate_probes::rdma::{PhysState, PortState};

    /// The event fast path as the probe loop runs it.
    fn fail_fast(
        report: &mut fabricgate_probes::ProbeReport,
        states: &[PortStateRead],
        judge: &mut crate::policy::judge::Judge,
        last: &crate::policy::Verdict,
    ) -> Option<crate::policy::Verdict> {
        if patch_port_states(report, states) {
            judge.port_event(report, last)
        } else {
            None
        }
    }

    #[test]
    fn a_port_read_down_fails_the_node_at_once_with_the_full_probes_reason() {
        let (mut report, config) = ndr_node();
        let judge = &mut crate::policy::judge::Judge::new(&config);
        let last = &crate::policy::evaluate(&report, &config);
        assert!(last.ready);
        let mut all = report.clone();
        // Nothing changed: nothing to say.
        let same = read("mlx5_0", PortState::Active, Some(PhysState::LinkUp));
        assert_eq!(fail_fast(&mut report, &[same], judge, last), None);
        // One of eight compute ports down: the fixture's requirements want all eight.
        let down = read("mlx5_0", PortState::Down, Some(PhysState::Disabled));
        let v = fail_fast(&mut report, std::slice::from_ref(&down), judge, last).unwrap();
        assert!(!v.ready);
        assert!(
            v.reasons()
                .iter()
                .any(|r| r.starts_with("mlx5_0 port 1: state DOWN, phys Disabled")),
            "{:?}",
            v.reasons()
        );
        // The same as a full probe of that state says.
        let port = &mut all.rdma.devices[0].ports[0];
        port.state = Some(PortState::Down);
        port.phys_state = Some(PhysState::Disabled);
        assert_eq!(v, crate::policy::evaluate(&all, &config));
        // A port coming back up is never judged good from a quick read.
        let up = read("mlx5_0", PortState::Active, Some(PhysState::LinkUp));
        assert_eq!(fail_fast(&mut report, &[up], judge, last), None);
        // Unknown devices are ignored.
        let other = read("mlx5_99", PortState::Down, None);
        assert_eq!(fail_fast(&mut report, &[other], judge, last), None);
    }
}
