//! The pod path: the mutating webhook for opted-in training pods and the `preflight` init
//! container it adds.

pub mod preflight;
pub mod webhook;
