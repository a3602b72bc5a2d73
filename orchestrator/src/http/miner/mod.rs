//! Signed routes for miners: join, heartbeat, leased work, uploads, completions,
//! pseudo-gradients, merges, downloads.

pub mod blobs;
pub mod complete;
pub mod join;
pub mod merges;
pub mod pseudo_gradients;
pub mod uploads;
pub mod work;
