-- Epochs whose scoring failed in a way a retry would repeat (a replay that errors on the
-- epoch's own records, a CLASP fit that cannot be computed): recorded and passed over, so one bad
-- epoch does not stop the scoring of every later one.
CREATE TABLE skipped_epochs (
    run_id     BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    reason     TEXT NOT NULL,
    skipped_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch)
);
