//! The validator's PostgreSQL database (`migrations/validator/`).

use iota_chain::ChainError;
use iota_chain::commit::{CommitStore, PendingCommit};
use iota_chain::wallet::PublicKey;
use sqlx::{PgPool, Row};

use crate::clasp::ClaspFit;
use crate::error::ValidatorError;
use crate::score::{CheckRow, EpochScore};
use iota_protocol::api::{ScoringParams, WeightsSet};

/// Where a weight submission came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// The validator's own stored scores.
    Scores,
    /// The chain's consensus weights, copied while the orchestrator was unreachable.
    Consensus,
}

impl WeightSource {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scores => "scores",
            Self::Consensus => "consensus",
        }
    }
}

/// One hotkey's score summed over the scored epochs.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ScoreTotal {
    pub hotkey: String,
    pub total: f64,
}

/// A weight submission as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct SubmissionRow {
    /// Row id.
    pub id: i64,
    /// Run the scores came from (none for consensus copies made before any connection).
    pub run_id: Option<i64>,
    /// Latest scored epoch the weights come from (none for consensus copies).
    pub epoch: Option<u64>,
    /// `scores` or `consensus`.
    pub source: String,
    /// Uids.
    pub uids: Vec<u16>,
    /// Normalised weights.
    pub weights: Vec<f64>,
    /// `pending`, `set`, `committed`, `revealed`, `failed`.
    pub state: String,
    /// Block it landed in (the reveal's block once revealed).
    pub block: Option<u64>,
    /// Version key sent.
    pub version_key: Option<u64>,
    /// The commit hash (`0x…`), when committed.
    pub commit_hash: Option<String>,
}

/// A CLASP effect as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct EffectRow {
    /// Miner.
    pub hotkey: String,
    /// Stage.
    pub stage: u32,
    /// Effect on the loss.
    pub effect: f64,
    /// Standard error.
    pub std_error: f64,
    /// z-score (0 when not finite).
    pub z: f64,
    /// Samples through the miner.
    pub samples: u64,
    /// Flagged as harmful.
    pub flagged: bool,
}

const SUBMISSION_COLUMNS: &str =
    "id, run_id, epoch, source, uids, weights, state, block, version_key, commit_hash";

fn submission_row(r: &sqlx::postgres::PgRow) -> Result<SubmissionRow, sqlx::Error> {
    Ok(SubmissionRow {
        id: r.try_get("id")?,
        run_id: r.try_get("run_id")?,
        epoch: r.try_get::<Option<i64>, _>("epoch")?.map(|e| e as u64),
        source: r.try_get("source")?,
        uids: r
            .try_get::<Vec<i32>, _>("uids")?
            .into_iter()
            .map(|u| u as u16)
            .collect(),
        weights: r.try_get("weights")?,
        state: r.try_get("state")?,
        block: r.try_get::<Option<i64>, _>("block")?.map(|b| b as u64),
        version_key: r
            .try_get::<Option<i64>, _>("version_key")?
            .map(|v| v as u64),
        commit_hash: r.try_get("commit_hash")?,
    })
}

/// The database.
#[derive(Clone, Debug)]
pub struct Store {
    db: PgPool,
}

impl Store {
    /// Connects and applies the migrations.
    pub async fn connect(url: &str) -> Result<Self, ValidatorError> {
        let db = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(url)
            .await?;
        sqlx::migrate!("../migrations/validator").run(&db).await?;
        Ok(Self { db })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.db
    }

    /// The secret mixed into spot-check draws, created on first use.
    pub async fn secret(&self) -> Result<[u8; 32], ValidatorError> {
        let fresh: [u8; 32] = rand::random();
        sqlx::query("INSERT INTO validator_secret (secret) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(fresh.to_vec())
            .execute(&self.db)
            .await?;
        let stored: Vec<u8> = sqlx::query_scalar("SELECT secret FROM validator_secret")
            .fetch_one(&self.db)
            .await?;
        stored
            .try_into()
            .map_err(|_| ValidatorError::Config("stored secret is not 32 bytes".into()))
    }

    /// Whether `epoch` of `run_id` is scored.
    pub async fn is_scored(&self, run_id: i64, epoch: u64) -> Result<bool, ValidatorError> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM scored_epochs WHERE run_id = $1 AND epoch = $2)",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_one(&self.db)
        .await?)
    }

    /// Records that `epoch` could not be scored for a reason a retry would repeat; the first
    /// reason recorded stays.
    pub async fn skip_epoch(
        &self,
        run_id: i64,
        epoch: u64,
        reason: &str,
    ) -> Result<(), ValidatorError> {
        sqlx::query(
            "INSERT INTO skipped_epochs (run_id, epoch, reason) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .bind(reason)
        .execute(&self.db)
        .await?;
        Ok(())
    }

    /// Why `epoch` was skipped, if it was.
    pub async fn skipped(&self, run_id: i64, epoch: u64) -> Result<Option<String>, ValidatorError> {
        Ok(
            sqlx::query_scalar(
                "SELECT reason FROM skipped_epochs WHERE run_id = $1 AND epoch = $2",
            )
            .bind(run_id)
            .bind(epoch as i64)
            .fetch_optional(&self.db)
            .await?,
        )
    }

    /// Stores an epoch's checks, CLASP fit and scores in one transaction.
    #[allow(clippy::too_many_arguments)]
    pub async fn record_epoch(
        &self,
        run_id: i64,
        epoch: u64,
        seed: &str,
        seed_block: u64,
        checks: &[CheckRow],
        clasp: Option<(&ClaspFit, &[String])>,
        scores: &[EpochScore],
        params: &ScoringParams,
    ) -> Result<(), ValidatorError> {
        let mut tx = self.db.begin().await?;
        let samples = clasp.map(|(f, _)| f.samples).unwrap_or(0);
        sqlx::query(
            "INSERT INTO scored_epochs (run_id, epoch, seed, seed_block, samples, params)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .bind(seed)
        .bind(seed_block as i64)
        .bind(samples as i64)
        .bind(serde_json::to_value(params).map_err(|e| ValidatorError::Config(e.to_string()))?)
        .execute(&mut *tx)
        .await?;
        for c in checks {
            sqlx::query(
                "INSERT INTO spot_checks (run_id, epoch, hotkey, kind, target, passed, detail)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(run_id)
            .bind(epoch as i64)
            .bind(&c.hotkey)
            .bind(&c.kind)
            .bind(&c.target)
            .bind(c.passed)
            .bind(&c.detail)
            .execute(&mut *tx)
            .await?;
        }
        if let Some((fit, hotkeys)) = clasp {
            for e in &fit.effects {
                let Some(hotkey) = hotkeys.get(e.miner as usize) else {
                    continue;
                };
                sqlx::query(
                    "INSERT INTO clasp_effects (run_id, epoch, hotkey, stage, effect, std_error, z, samples, flagged)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                )
                .bind(run_id)
                .bind(epoch as i64)
                .bind(hotkey)
                .bind(e.stage as i32)
                .bind(e.effect)
                .bind(e.std_error)
                .bind(if e.z.is_finite() { e.z } else { 0.0 })
                .bind(e.samples as i64)
                .bind(e.flagged)
                .execute(&mut *tx)
                .await?;
            }
        }
        for s in scores {
            sqlx::query(
                "INSERT INTO scores (run_id, epoch, hotkey, work, quality, score, penalty)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(run_id)
            .bind(epoch as i64)
            .bind(&s.hotkey)
            .bind(s.work)
            .bind(s.quality)
            .bind(s.score)
            .bind(&s.penalty)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Scores of the `window` latest scored epochs of `run_id`.
    pub async fn recent_scores(
        &self,
        run_id: i64,
        window: u64,
    ) -> Result<Vec<EpochScore>, ValidatorError> {
        let rows = sqlx::query(
            "SELECT epoch, hotkey, work, quality, score, penalty FROM scores
             WHERE run_id = $1 AND epoch > (SELECT coalesce(max(epoch), 0) FROM scores WHERE run_id = $1) - $2
             ORDER BY epoch, hotkey",
        )
        .bind(run_id)
        .bind(window as i64)
        .fetch_all(&self.db)
        .await?;
        rows.iter().map(score_row).collect()
    }

    /// The latest scored epoch's scores (any run): `(epoch, hotkey, work, quality, score,
    /// penalty)`, best first.
    #[allow(clippy::type_complexity)]
    pub async fn latest_scores(
        &self,
    ) -> Result<Vec<(i64, String, f64, f64, f64, Option<String>)>, ValidatorError> {
        Ok(sqlx::query_as(
            "SELECT epoch, hotkey, work, quality, score, penalty FROM scores
             WHERE (run_id, epoch) = (SELECT run_id, epoch FROM scored_epochs ORDER BY scored_at DESC LIMIT 1)
             ORDER BY score DESC, hotkey",
        )
        .fetch_all(&self.db)
        .await?)
    }

    /// Every hotkey's score summed over all the epochs this validator scored (every run), by
    /// hotkey: what `localnet up` reports per neuron.
    pub async fn score_totals(&self) -> Result<Vec<ScoreTotal>, ValidatorError> {
        Ok(sqlx::query_as(
            "SELECT hotkey, sum(score) AS total FROM scores GROUP BY hotkey ORDER BY hotkey",
        )
        .fetch_all(&self.db)
        .await?)
    }

    /// Latest scored epoch of `run_id`.
    pub async fn latest_scored(&self, run_id: i64) -> Result<Option<u64>, ValidatorError> {
        let e: Option<i64> =
            sqlx::query_scalar("SELECT max(epoch) FROM scored_epochs WHERE run_id = $1")
                .bind(run_id)
                .fetch_one(&self.db)
                .await?;
        Ok(e.map(|e| e as u64))
    }

    /// Records a submission about to be sent; returns its id.
    pub async fn begin_submission(
        &self,
        run_id: Option<i64>,
        epoch: Option<u64>,
        netuid: u16,
        uids: &[u16],
        weights: &[f64],
        source: WeightSource,
    ) -> Result<i64, ValidatorError> {
        let uids: Vec<i32> = uids.iter().map(|u| i32::from(*u)).collect();
        Ok(sqlx::query_scalar(
            "INSERT INTO weight_submissions (run_id, epoch, netuid, uids, weights, state, source)
             VALUES ($1, $2, $3, $4, $5, 'pending', $6) RETURNING id",
        )
        .bind(run_id)
        .bind(epoch.map(|e| e as i64))
        .bind(i32::from(netuid))
        .bind(uids)
        .bind(weights)
        .bind(source.as_str())
        .fetch_one(&self.db)
        .await?)
    }

    /// The block of the latest submission that reached the chain (set, committed or revealed),
    /// whatever its source.
    pub async fn last_submission_block(&self) -> Result<Option<u64>, ValidatorError> {
        let b: Option<i64> = sqlx::query_scalar(
            "SELECT max(block) FROM weight_submissions
             WHERE state IN ('set', 'committed', 'revealed')",
        )
        .fetch_one(&self.db)
        .await?;
        Ok(b.map(|b| b as u64))
    }

    /// The latest submission made from the scores of `run_id` whose latest scored epoch is
    /// `epoch` and that reached the chain (or was a dry run).
    pub async fn submission_for_epoch(
        &self,
        run_id: i64,
        epoch: u64,
    ) -> Result<Option<SubmissionRow>, ValidatorError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SUBMISSION_COLUMNS} FROM weight_submissions
             WHERE run_id = $1 AND epoch = $2 AND source = 'scores'
               AND state IN ('set', 'committed', 'revealed', 'dry_run')
             ORDER BY id DESC LIMIT 1"
        )))
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_optional(&self.db)
        .await?;
        Ok(row.as_ref().map(submission_row).transpose()?)
    }

    /// Scores of `run_id` for epochs `from..=to`.
    pub async fn scores_between(
        &self,
        run_id: i64,
        from: u64,
        to: u64,
    ) -> Result<Vec<EpochScore>, ValidatorError> {
        let rows = sqlx::query(
            "SELECT epoch, hotkey, work, quality, score, penalty FROM scores
             WHERE run_id = $1 AND epoch BETWEEN $2 AND $3 ORDER BY epoch, hotkey",
        )
        .bind(run_id)
        .bind(from as i64)
        .bind(to as i64)
        .fetch_all(&self.db)
        .await?;
        rows.iter().map(score_row).collect()
    }

    /// Epochs of `run_id` scored within `from..=to`, ascending.
    pub async fn scored_between(
        &self,
        run_id: i64,
        from: u64,
        to: u64,
    ) -> Result<Vec<u64>, ValidatorError> {
        let e: Vec<i64> = sqlx::query_scalar(
            "SELECT epoch FROM scored_epochs WHERE run_id = $1 AND epoch BETWEEN $2 AND $3
             ORDER BY epoch",
        )
        .bind(run_id)
        .bind(from as i64)
        .bind(to as i64)
        .fetch_all(&self.db)
        .await?;
        Ok(e.into_iter().map(|e| e as u64).collect())
    }

    /// Scored epochs of `run_id` whose checks and scores have not reached the orchestrator yet,
    /// oldest first, at most `limit`.
    pub async fn unpublished(&self, run_id: i64, limit: u32) -> Result<Vec<u64>, ValidatorError> {
        let e: Vec<i64> = sqlx::query_scalar(
            "SELECT epoch FROM scored_epochs WHERE run_id = $1 AND published_at IS NULL
             ORDER BY epoch LIMIT $2",
        )
        .bind(run_id)
        .bind(i64::from(limit))
        .fetch_all(&self.db)
        .await?;
        Ok(e.into_iter().map(|e| e as u64).collect())
    }

    /// Records that `epoch`'s checks and scores reached the orchestrator.
    pub async fn set_published(&self, run_id: i64, epoch: u64) -> Result<(), ValidatorError> {
        sqlx::query(
            "UPDATE scored_epochs SET published_at = now() WHERE run_id = $1 AND epoch = $2",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .execute(&self.db)
        .await?;
        Ok(())
    }

    /// The settings `epoch` was scored with (`None`: scored before they were kept).
    pub async fn params(
        &self,
        run_id: i64,
        epoch: u64,
    ) -> Result<Option<ScoringParams>, ValidatorError> {
        let v: Option<Option<serde_json::Value>> =
            sqlx::query_scalar("SELECT params FROM scored_epochs WHERE run_id = $1 AND epoch = $2")
                .bind(run_id)
                .bind(epoch as i64)
                .fetch_optional(&self.db)
                .await?;
        v.flatten()
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| ValidatorError::Config(format!("stored scoring settings: {e}")))
    }

    /// The weights on chain from the scores of `epoch` (set, or committed and revealed), as
    /// sent: the latest such submission.
    pub async fn weights_on_chain(
        &self,
        run_id: i64,
        epoch: u64,
    ) -> Result<Option<WeightsSet>, ValidatorError> {
        let row: Option<(i64, serde_json::Value)> = sqlx::query_as(
            "SELECT block, outcome FROM weight_submissions
             WHERE run_id = $1 AND epoch = $2 AND source = 'scores'
               AND state IN ('set', 'revealed') AND block IS NOT NULL AND outcome IS NOT NULL
             ORDER BY id DESC LIMIT 1",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_optional(&self.db)
        .await?;
        let Some((block, outcome)) = row else {
            return Ok(None);
        };
        #[derive(serde::Deserialize)]
        struct Sent {
            uids: Vec<u16>,
            values: Vec<u16>,
        }
        let sent: Sent = serde_json::from_value(outcome)
            .map_err(|e| ValidatorError::Config(format!("stored weight outcome: {e}")))?;
        Ok(Some(WeightsSet {
            block: block as u64,
            uids: sent.uids,
            weights: sent.values,
        }))
    }

    /// The seed and seed block `epoch`'s spot checks were drawn with.
    pub async fn seed(
        &self,
        run_id: i64,
        epoch: u64,
    ) -> Result<Option<(String, u64)>, ValidatorError> {
        let row: Option<(String, i64)> = sqlx::query_as(
            "SELECT seed, seed_block FROM scored_epochs WHERE run_id = $1 AND epoch = $2",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_optional(&self.db)
        .await?;
        Ok(row.map(|(seed, block)| (seed, block as u64)))
    }

    /// The checks of `run_id`'s `epoch`, in the order they ran.
    pub async fn checks(&self, run_id: i64, epoch: u64) -> Result<Vec<CheckRow>, ValidatorError> {
        let rows = sqlx::query(
            "SELECT hotkey, kind, target, passed, detail FROM spot_checks
             WHERE run_id = $1 AND epoch = $2 ORDER BY id",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_all(&self.db)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(CheckRow {
                    hotkey: r.try_get("hotkey")?,
                    kind: r.try_get("kind")?,
                    target: r.try_get("target")?,
                    passed: r.try_get("passed")?,
                    detail: r.try_get("detail")?,
                })
            })
            .collect()
    }

    /// The CLASP effects of `run_id`'s `epoch`, by hotkey.
    pub async fn effects(&self, run_id: i64, epoch: u64) -> Result<Vec<EffectRow>, ValidatorError> {
        let rows = sqlx::query(
            "SELECT hotkey, stage, effect, std_error, z, samples, flagged FROM clasp_effects
             WHERE run_id = $1 AND epoch = $2 ORDER BY hotkey",
        )
        .bind(run_id)
        .bind(epoch as i64)
        .fetch_all(&self.db)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(EffectRow {
                    hotkey: r.try_get("hotkey")?,
                    stage: r.try_get::<i32, _>("stage")? as u32,
                    effect: r.try_get("effect")?,
                    std_error: r.try_get("std_error")?,
                    z: r.try_get("z")?,
                    samples: r.try_get::<i64, _>("samples")? as u64,
                    flagged: r.try_get("flagged")?,
                })
            })
            .collect()
    }

    /// The saved reveal data of the commit with `hash` (`0x…`), while it is unrevealed.
    pub async fn pending_commit(
        &self,
        hash: &str,
    ) -> Result<Option<PendingCommit>, ValidatorError> {
        let v: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT commit FROM pending_commits WHERE hash = $1")
                .bind(hash)
                .fetch_optional(&self.db)
                .await?;
        v.map(|v| {
            serde_json::from_value(v)
                .map_err(|e| ValidatorError::BadObject(format!("stored commit {hash}: {e}")))
        })
        .transpose()
    }

    /// Records what became of submission `id`.
    pub async fn finish_submission(
        &self,
        id: i64,
        state: &str,
        block: Option<u64>,
        version_key: Option<u64>,
        commit_hash: Option<&str>,
        outcome: &serde_json::Value,
    ) -> Result<(), ValidatorError> {
        sqlx::query(
            "UPDATE weight_submissions SET state = $2, block = $3, version_key = $4,
                 commit_hash = coalesce($5, commit_hash), outcome = $6, updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .bind(state)
        .bind(block.map(|b| b as i64))
        .bind(version_key.map(|v| v as i64))
        .bind(commit_hash)
        .bind(outcome)
        .execute(&self.db)
        .await?;
        if state == "set" {
            self.republish("id = $1", id).await?;
        }
        Ok(())
    }

    /// Marks for publication again the scored epoch whose scores made the submission `which`
    /// names (`$1`): its weights are on chain now and go out with its scores.
    async fn republish<T>(&self, which: &str, key: T) -> Result<(), ValidatorError>
    where
        T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
    {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE scored_epochs e SET published_at = NULL FROM weight_submissions w
             WHERE w.{which} AND w.source = 'scores'
               AND e.run_id = w.run_id AND e.epoch = w.epoch"
        )))
        .bind(key)
        .execute(&self.db)
        .await?;
        Ok(())
    }

    /// A commit the chain would not reveal (its window passed): its submission failed.
    pub async fn mark_dropped(&self, hash: &str, why: &str) -> Result<(), ValidatorError> {
        sqlx::query(
            "UPDATE weight_submissions SET state = 'failed',
                 outcome = jsonb_build_object('error', $2::text), updated_at = now()
             WHERE commit_hash = $1 AND state = 'committed'",
        )
        .bind(hash)
        .bind(why)
        .execute(&self.db)
        .await?;
        Ok(())
    }

    /// Settles the submissions a stopped validator left `pending`: one whose commit is still in
    /// the commit store becomes `committed` (its reveal follows); the others `failed`, their
    /// outcome unknown. Returns how many were settled. Call before this validator submits.
    pub async fn recover_interrupted(&self) -> Result<u64, ValidatorError> {
        Ok(sqlx::query(
            "UPDATE weight_submissions w SET
                 state = CASE WHEN c.hash IS NULL THEN 'failed' ELSE 'committed' END,
                 outcome = CASE WHEN c.hash IS NULL THEN jsonb_build_object('error',
                     'interrupted: the validator stopped before the outcome was recorded')
                     ELSE w.outcome END,
                 updated_at = now()
             FROM weight_submissions p LEFT JOIN pending_commits c ON c.hash = p.commit_hash
             WHERE p.id = w.id AND w.state = 'pending'",
        )
        .execute(&self.db)
        .await?
        .rows_affected())
    }

    /// Marks the committed submission with `hash` revealed at `block`.
    pub async fn mark_revealed(&self, hash: &str, block: u64) -> Result<(), ValidatorError> {
        sqlx::query(
            "UPDATE weight_submissions SET state = 'revealed', block = $2, updated_at = now()
             WHERE commit_hash = $1",
        )
        .bind(hash)
        .bind(block as i64)
        .execute(&self.db)
        .await?;
        self.republish("commit_hash = $1", hash.to_owned()).await?;
        Ok(())
    }

    /// The latest submissions, newest first.
    pub async fn submissions(&self, limit: i64) -> Result<Vec<SubmissionRow>, ValidatorError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SUBMISSION_COLUMNS} FROM weight_submissions ORDER BY id DESC LIMIT $1"
        )))
        .bind(limit)
        .fetch_all(&self.db)
        .await?;
        Ok(rows.iter().map(submission_row).collect::<Result<_, _>>()?)
    }
}

fn score_row(r: &sqlx::postgres::PgRow) -> Result<EpochScore, ValidatorError> {
    Ok(EpochScore {
        epoch: r.try_get::<i64, _>("epoch")? as u64,
        hotkey: r.try_get("hotkey")?,
        work: r.try_get("work")?,
        quality: r.try_get("quality")?,
        score: r.try_get("score")?,
        penalty: r.try_get("penalty")?,
    })
}

fn db_err(e: sqlx::Error) -> ChainError {
    ChainError::InvalidArgument(format!("commit store: {e}"))
}

impl CommitStore for Store {
    async fn save(&self, commit: &PendingCommit) -> Result<(), ChainError> {
        let json = serde_json::to_value(commit)
            .map_err(|e| ChainError::InvalidArgument(format!("commit store: {e}")))?;
        // `xmax = 0`: the row is new (an update of a known commit returns false).
        let new: bool = sqlx::query_scalar(
            "INSERT INTO pending_commits (hash, hotkey, commit) VALUES ($1, $2, $3)
             ON CONFLICT (hash) DO UPDATE SET commit = EXCLUDED.commit
             RETURNING (xmax = 0)",
        )
        .bind(commit.hash_hex())
        .bind(commit.hotkey.ss58())
        .bind(json)
        .fetch_one(&self.db)
        .await
        .map_err(db_err)?;
        if !new {
            return Ok(());
        }
        // A new commit belongs to the submission in flight (the newest, still pending): linking
        // them now lets a restart tell a commit that was sent from one that never left.
        sqlx::query(
            "UPDATE weight_submissions SET commit_hash = $1
             WHERE id = (SELECT max(id) FROM weight_submissions)
               AND state = 'pending' AND commit_hash IS NULL",
        )
        .bind(commit.hash_hex())
        .execute(&self.db)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    async fn pending(&self, hotkey: &PublicKey) -> Result<Vec<PendingCommit>, ChainError> {
        let rows: Vec<serde_json::Value> = sqlx::query_scalar(
            "SELECT commit FROM pending_commits WHERE hotkey = $1 ORDER BY created_at",
        )
        .bind(hotkey.ss58())
        .fetch_all(&self.db)
        .await
        .map_err(db_err)?;
        rows.into_iter()
            .map(|v| {
                serde_json::from_value(v)
                    .map_err(|e| ChainError::InvalidArgument(format!("commit store: {e}")))
            })
            .collect()
    }

    async fn remove(&self, hash: &[u8; 32]) -> Result<(), ChainError> {
        sqlx::query("DELETE FROM pending_commits WHERE hash = $1")
            .bind(format!("0x{}", hex::encode(hash)))
            .execute(&self.db)
            .await
            .map_err(db_err)?;
        Ok(())
    }
}
