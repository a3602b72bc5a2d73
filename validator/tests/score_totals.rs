//! `Store::score_totals`: every hotkey's score summed over the epochs (and runs) it was scored in.

use iota_validator::score::EpochScore;
use iota_validator::{ScoreTotal, Store};

use crate::common::fresh_db;

fn score(hotkey: &str, epoch: u64, score: f64) -> EpochScore {
    EpochScore {
        hotkey: hotkey.into(),
        epoch,
        work: score,
        quality: 1.0,
        score,
        penalty: None,
    }
}

#[tokio::test]
async fn score_totals_sum_every_scored_epoch_per_hotkey() {
    let store = Store::connect(&fresh_db().await)
        .await
        .expect("validator db");
    assert!(store.score_totals().await.expect("no scores").is_empty());
    store
        .record_epoch(
            1,
            0,
            "seed",
            0,
            &[],
            None,
            &[score("b", 0, 2.0), score("a", 0, 1.0)],
            &params(),
        )
        .await
        .expect("epoch 0");
    store
        .record_epoch(1, 1, "seed", 5, &[], None, &[score("a", 1, 0.5)], &params())
        .await
        .expect("epoch 1");
    // Another run's epochs count too, as they did in `localnet up`'s report.
    store
        .record_epoch(2, 0, "seed", 9, &[], None, &[score("b", 0, 4.0)], &params())
        .await
        .expect("run 2");
    assert_eq!(
        store.score_totals().await.expect("totals"),
        vec![
            ScoreTotal {
                hotkey: "a".into(),
                total: 1.5
            },
            ScoreTotal {
                hotkey: "b".into(),
                total: 6.0
            },
        ]
    );
}

/// The default scoring settings, as published.
fn params() -> iota_protocol::api::ScoringParams {
    iota_validator::published::params(&Default::default(), &Default::default(), None)
}
