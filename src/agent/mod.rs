//! The per-node agent: `fabricgate run` (the probe loop, kernel wake-ups, the Node writer's
//! loop) and the one-shot node commands `check` and `selftest`. It schedules and wires the other
//! floors together; it never decides a verdict itself.

pub mod check;
pub mod daemon;
mod mesh;
mod probe_loop;
mod probe_thread;
mod reconcile_loop;
pub mod selftest;
mod timing;
pub mod wakeup;
