-- A validator's own record: what it checked, what CLASP found, the scores, and every weight
-- submission. Scores are committed before the weights they produce are sent, and a submission
-- is built from these tables, never from memory.

-- The secret mixed into every spot-check draw (one row).
CREATE TABLE validator_secret (
    id         BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (id),
    secret     BYTEA NOT NULL CHECK (length(secret) = 32),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Epochs scored, with the seed the draw came from.
CREATE TABLE scored_epochs (
    run_id      BIGINT NOT NULL,
    epoch       BIGINT NOT NULL,
    seed        TEXT NOT NULL,
    seed_block  BIGINT NOT NULL,
    samples     BIGINT NOT NULL,
    scored_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch)
);

CREATE TABLE spot_checks (
    id         BIGSERIAL PRIMARY KEY,
    run_id     BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    hotkey     TEXT NOT NULL,
    kind       TEXT NOT NULL,      -- replay, merge
    target     TEXT NOT NULL,
    passed     BOOLEAN NOT NULL,
    detail     JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX spot_checks_epoch ON spot_checks (run_id, epoch);

CREATE TABLE clasp_effects (
    run_id     BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    hotkey     TEXT NOT NULL,
    stage      INTEGER NOT NULL,
    effect     DOUBLE PRECISION NOT NULL,
    std_error  DOUBLE PRECISION NOT NULL,
    z          DOUBLE PRECISION NOT NULL,
    samples    BIGINT NOT NULL,
    flagged    BOOLEAN NOT NULL,
    PRIMARY KEY (run_id, epoch, hotkey)
);

CREATE TABLE scores (
    run_id     BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    hotkey     TEXT NOT NULL,
    work       DOUBLE PRECISION NOT NULL,
    quality    DOUBLE PRECISION NOT NULL,
    score      DOUBLE PRECISION NOT NULL,
    penalty    TEXT,
    PRIMARY KEY (run_id, epoch, hotkey)
);

-- Every weight submission and what became of it.
CREATE TABLE weight_submissions (
    id          BIGSERIAL PRIMARY KEY,
    run_id      BIGINT NOT NULL,
    epoch       BIGINT NOT NULL,         -- the latest scored epoch they come from
    netuid      INTEGER NOT NULL,
    uids        INTEGER[] NOT NULL,
    weights     DOUBLE PRECISION[] NOT NULL,
    state       TEXT NOT NULL,           -- pending, set, committed, revealed, failed
    block       BIGINT,
    version_key BIGINT,
    commit_hash TEXT,
    outcome     JSONB,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Commits waiting for their reveal (the chain client's CommitStore), surviving restarts.
CREATE TABLE pending_commits (
    hash       TEXT PRIMARY KEY,
    hotkey     TEXT NOT NULL,
    commit     JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
