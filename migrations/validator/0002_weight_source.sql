-- Where a weight submission came from: the validator's own scores, or the chain's consensus
-- weights copied while the orchestrator was unreachable (no run or epoch behind those).
ALTER TABLE weight_submissions
    ADD COLUMN source TEXT NOT NULL DEFAULT 'scores' CHECK (source IN ('scores', 'consensus')),
    ALTER COLUMN run_id DROP NOT NULL,
    ALTER COLUMN epoch DROP NOT NULL;
CREATE INDEX weight_submissions_epoch ON weight_submissions (run_id, epoch);
