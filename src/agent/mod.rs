//! The per-node agent: `fabricgate run` (the probe loop, kernel wake-ups, the Node writer's
//! loop) and the one-shot node commands `check` and `selftest`. It schedules and wires the other
//! floors together; it never decides a verdict itself.

pub mod check;
pub mod daemon;
mod probe_loop;
mod reconcile_loop;
pub mod registration;
pub mod ring;
pub mod selftest;
pub mod wakeup;
