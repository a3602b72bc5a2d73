//! Shared set-up of the `iota` binary's integration tests.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Waits for `child` to exit, killing it and failing the test once `limit` has passed.
pub fn wait_within(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} took more than {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
