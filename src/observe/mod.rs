//! What Prometheus and the kubelet see: the metric registry and its exposition, the TCP
//! fallback detector, the health endpoints and the hardened HTTP server that serves them.

pub mod counters;
pub mod events;
pub mod exposition;
pub mod fallback;
pub mod health;
pub mod metrics;
pub mod server;
