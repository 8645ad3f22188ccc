//! What Prometheus sees: `/metrics` against golden files and over synthetic nodes
//! (`exposition`), the GPUDirect series, the alert rules under promtool, and a real Prometheus
//! scraping the agent and running the dashboard's queries.

mod common;

#[path = "metrics/exposition.rs"]
mod exposition;
#[path = "metrics/gpudirect_metrics.rs"]
mod gpudirect_metrics;
#[path = "metrics/guard_metrics.rs"]
mod guard_metrics;
#[path = "metrics/prometheus_rules.rs"]
mod prometheus_rules;
#[path = "metrics/prometheus_server.rs"]
mod prometheus_server;
