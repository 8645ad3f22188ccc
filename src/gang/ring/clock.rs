//! The time a FabricCheck's deadline is read against: the API server's, not this node's. An
//! agent whose clock ran ahead by more than `gang.timeout` took every check as past its
//! deadline and answered none, so every gang with its node failed. The
//! offset of the API server's clock from ours is read from the `Date` header of a list of one
//! FabricCheck (a request the agent's Role already grants; no other), at most once a minute
//! and only while checks arrive.

use k8s_openapi::jiff::fmt::rfc2822::DateTimeParser;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::time::{Duration, Instant};

/// How long a measured offset is used before it is measured again.
pub const REFRESH: Duration = Duration::from_secs(60);

static HTTP_DATE: DateTimeParser = DateTimeParser::new();

/// The API server's clock as this agent reads it.
pub struct ServerClock {
    /// Test-only: added to this node's clock (`FABRICGATE_FAILPOINT=clock-ahead`).
    skew: SignedDuration,
    /// The API server's clock minus ours, and when that was measured.
    offset: Option<(SignedDuration, Instant)>,
    warned: bool,
}

impl ServerClock {
    /// `ahead`: how far this node's clock is made to read ahead (zero outside tests).
    pub fn new(ahead: Duration) -> Self {
        Self {
            skew: SignedDuration::try_from(ahead).unwrap_or_default(),
            offset: None,
            warned: false,
        }
    }

    /// This node's own clock.
    pub fn local(&self) -> Timestamp {
        let now = Timestamp::now();
        now.checked_add(self.skew).unwrap_or(now)
    }

    /// The API server's time now: our clock plus the offset last measured (again after
    /// [`REFRESH`]); our own clock while the API server's cannot be read.
    /// `namespace`: the checks' (`gang.namespace`).
    /// `selector`: this node's member label, so the list reads at most one of its own checks.
    pub async fn now(
        &mut self,
        client: &kube::Client,
        namespace: &str,
        selector: &str,
    ) -> Timestamp {
        let fresh = self.offset.is_some_and(|(_, at)| at.elapsed() < REFRESH);
        if !fresh {
            match self.measure(client, namespace, selector).await {
                Ok(offset) => {
                    if offset.abs() > SignedDuration::from_secs(2) {
                        tracing::warn!(
                            offset_seconds = offset.as_secs_f64(),
                            "this node's clock differs from the API server's; gang pre-flight \
                             deadlines are read against the API server's (run NTP on the node)"
                        );
                    }
                    self.offset = Some((offset, Instant::now()));
                    self.warned = false;
                }
                Err(e) => {
                    if !self.warned {
                        tracing::warn!(
                            error = %e,
                            "cannot read the API server's time (the Date header of a \
                             FabricCheck list); gang pre-flight deadlines are read against this node's \
                             clock until it can"
                        );
                        self.warned = true;
                    }
                }
            }
        }
        let local = self.local();
        let offset = self.offset.map_or(SignedDuration::ZERO, |(o, _)| o);
        local.checked_add(offset).unwrap_or(local)
    }

    async fn measure(
        &self,
        client: &kube::Client,
        namespace: &str,
        selector: &str,
    ) -> Result<SignedDuration, String> {
        use crate::gang::fabriccheck::{CHECK_PLURAL, GROUP, VERSION};
        // Any answer carries the Date, an error too: the status is not looked at.
        // A label key's `/` is the one character of it a query must escape.
        let selector = selector.replace('/', "%2F");
        let url = format!(
            "/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{CHECK_PLURAL}?limit=1&labelSelector={selector}"
        );
        let request = http::Request::get(url)
            .body(kube::client::Body::empty())
            .map_err(|e| e.to_string())?;
        let sent = self.local();
        let response = client.send(request).await.map_err(|e| e.to_string())?;
        let received = self.local();
        let date = response
            .headers()
            .get(http::header::DATE)
            .and_then(|v| v.to_str().ok())
            .ok_or("the response has no Date header")?;
        offset_from_date(date, sent, received)
            .ok_or_else(|| format!("the Date header {date:?} is not an HTTP date"))
    }
}

/// The API server's clock minus ours, from a `Date` header received between `sent` and
/// `received` (our clock). The header is whole seconds, cut down: its middle is half a
/// second later.
pub(crate) fn offset_from_date(
    date: &str,
    sent: Timestamp,
    received: Timestamp,
) -> Option<SignedDuration> {
    let server = HTTP_DATE
        .parse_timestamp(date)
        .ok()?
        .checked_add(SignedDuration::from_millis(500))
        .ok()?;
    let half_trip = received.duration_since(sent) / 2;
    let ours = sent.checked_add(half_trip).ok()?;
    Some(server.duration_since(ours))
}
