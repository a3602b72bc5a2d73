//! A validator stopped in the middle of a weight submission, or whose commit expired, leaves no
//! submission `pending` or `committed` for ever; an epoch it skipped stays skipped with its
//! reason. Needs `DATABASE_URL` (scripts/test.sh).

use iota_chain::commit::{CommitStore, PendingCommit};
use iota_chain::wallet::PublicKey;
use iota_validator::{Store, WeightSource};

async fn fresh_store() -> Store {
    Store::connect(&crate::support::fresh_db().await)
        .await
        .expect("store")
}

fn commit(n: u8) -> PendingCommit {
    PendingCommit {
        hotkey: PublicKey::from_bytes([7; 32]),
        netuid: 9,
        uids: vec![1, 2],
        values: vec![65535, 30000],
        salt: vec![u16::from(n); 8],
        version_key: 0,
        hash: [n; 32],
        submitted_block: 10,
        commit_block: None,
        reveal_epoch: 3,
        timelock: None,
    }
}

async fn state(store: &Store, id: i64) -> (String, Option<String>) {
    sqlx::query_as("SELECT state, commit_hash FROM weight_submissions WHERE id = $1")
        .bind(id)
        .fetch_one(store.pool())
        .await
        .expect("submission")
}

#[tokio::test]
async fn interrupted_and_dropped_submissions_are_settled() {
    let store = fresh_store().await;
    // Stopped after its commit was sent (the salt is saved first) but before the outcome.
    let sent = store
        .begin_submission(
            Some(1),
            Some(0),
            9,
            &[1, 2],
            &[1.0, 0.5],
            WeightSource::Scores,
        )
        .await
        .expect("begin");
    store.save(&commit(1)).await.expect("save");
    let hash = commit(1).hash_hex();
    assert_eq!(state(&store, sent).await.1.as_deref(), Some(hash.as_str()));
    // Stopped before anything was sent.
    let unsent = store
        .begin_submission(Some(1), Some(1), 9, &[1], &[1.0], WeightSource::Scores)
        .await
        .expect("begin");

    // The restart settles both: the sent commit waits for its reveal, the other failed.
    assert_eq!(store.recover_interrupted().await.expect("recover"), 2);
    assert_eq!(
        state(&store, sent).await,
        ("committed".into(), Some(hash.clone()))
    );
    assert_eq!(state(&store, unsent).await.0, "failed");
    store.mark_revealed(&hash, 40).await.expect("revealed");
    assert_eq!(state(&store, sent).await.0, "revealed");
    assert_eq!(store.recover_interrupted().await.expect("again"), 0);

    // A commit whose reveal the chain refused (the window passed) fails its submission; a
    // later save of the same commit does not attach it to another submission.
    let late = store
        .begin_submission(
            Some(1),
            Some(2),
            9,
            &[1, 2],
            &[1.0, 1.0],
            WeightSource::Scores,
        )
        .await
        .expect("begin");
    store.save(&commit(2)).await.expect("save");
    let hash2 = commit(2).hash_hex();
    store
        .finish_submission(
            late,
            "committed",
            Some(50),
            Some(0),
            Some(&hash2),
            &serde_json::json!({}),
        )
        .await
        .expect("finish");
    let next = store
        .begin_submission(Some(1), Some(3), 9, &[1], &[1.0], WeightSource::Scores)
        .await
        .expect("begin");
    let mut known = commit(2);
    known.commit_block = Some(51);
    store.save(&known).await.expect("save again");
    assert_eq!(state(&store, next).await, ("pending".into(), None));
    store
        .mark_dropped(&hash2, "ExpiredWeightCommit")
        .await
        .expect("dropped");
    assert_eq!(state(&store, late).await.0, "failed");
}

/// An epoch skipped for a failure a retry would repeat keeps its first reason; others are not
/// skipped.
#[tokio::test]
async fn a_skipped_epoch_keeps_its_first_reason() {
    let store = fresh_store().await;
    assert_eq!(store.skipped(1, 4).await.expect("read"), None);
    store
        .skip_epoch(1, 4, "clasp: 1 samples")
        .await
        .expect("skip");
    store.skip_epoch(1, 4, "another").await.expect("skip again");
    assert_eq!(
        store.skipped(1, 4).await.expect("read").as_deref(),
        Some("clasp: 1 samples")
    );
    assert_eq!(store.skipped(1, 5).await.expect("read"), None);
    assert_eq!(store.skipped(2, 4).await.expect("read"), None);
}
