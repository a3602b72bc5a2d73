use super::*;
use rand::SeedableRng;

#[test]
fn backoff_is_capped_and_jittered() {
    let p = RetryPolicy {
        attempts: 10,
        base: Duration::from_millis(100),
        max: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let waits: Vec<Duration> = (0..200).map(|_| p.backoff(30, &mut rng)).collect();
    assert!(waits.iter().all(|w| *w <= Duration::from_secs(1)));
    // Full jitter: not all the same, and some well under the cap.
    assert!(waits.iter().any(|w| *w < Duration::from_millis(500)));
    assert!(waits.iter().any(|w| *w > Duration::from_millis(500)));
    assert!(p.backoff(0, &mut rng) <= Duration::from_millis(100));
}

#[test]
fn the_first_retry_waits_the_base_at_most_and_later_ones_longer() {
    let p = RetryPolicy {
        attempts: 6,
        base: Duration::from_millis(100),
        max: Duration::from_secs(10),
        timeout: Duration::from_secs(1),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut draws =
        |n: u32| -> Vec<Duration> { (0..200).map(|_| p.wait_before(n, None, &mut rng)).collect() };
    let first = draws(1);
    assert!(first.iter().all(|w| *w <= p.base), "{first:?}");
    // The third attempt's cap is four times the base: some waits pass the second's.
    let third = draws(3);
    assert!(third.iter().all(|w| *w <= p.base * 4), "{third:?}");
    assert!(third.iter().any(|w| *w > p.base * 2), "{third:?}");
    // A server's Retry-After longer than the backoff is what is waited.
    let asked = Duration::from_secs(5);
    assert_eq!(p.wait_before(1, Some(asked), &mut rng), asked);
    // The first attempt goes at once.
    assert_eq!(p.wait_before(0, Some(asked), &mut rng), Duration::ZERO);
}
