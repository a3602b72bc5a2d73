-- Orchestrator run state. Every handler is idempotent through the unique keys below; the phase
-- driver (whichever process holds the advisory lock) is the only writer of phase changes.

CREATE TABLE runs (
    id              BIGSERIAL PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    config          JSONB NOT NULL,
    netuid          INTEGER NOT NULL,
    orchestrator    TEXT NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The current epoch and phase; the epochs table keeps the history.
    epoch           BIGINT NOT NULL DEFAULT 0,
    phase           TEXT NOT NULL DEFAULT 'training'
                    CHECK (phase IN ('training', 'uploading', 'merging')),
    phase_started   TIMESTAMPTZ NOT NULL DEFAULT now(),
    phase_deadline  TIMESTAMPTZ NOT NULL DEFAULT now(),
    merge_round     INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE epochs (
    run_id            BIGINT NOT NULL REFERENCES runs(id),
    epoch             BIGINT NOT NULL,
    started_at        TIMESTAMPTZ NOT NULL,
    training_ended_at TIMESTAMPTZ,
    uploading_ended_at TIMESTAMPTZ,
    ended_at          TIMESTAMPTZ,
    samples_started   BIGINT NOT NULL DEFAULT 0,
    samples_completed BIGINT NOT NULL DEFAULT 0,
    wire_bytes        BIGINT NOT NULL DEFAULT 0,
    -- Objects of this epoch were garbage-collected (retention passed).
    gc_done           BOOLEAN NOT NULL DEFAULT false,
    PRIMARY KEY (run_id, epoch)
);

CREATE TABLE miners (
    run_id        BIGINT NOT NULL REFERENCES runs(id),
    hotkey        TEXT NOT NULL,
    uid           INTEGER NOT NULL,
    stage         INTEGER NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('active', 'released')),
    device        TEXT NOT NULL,
    memory_bytes  BIGINT NOT NULL,
    tokens_per_s  DOUBLE PRECISION NOT NULL,
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen     TIMESTAMPTZ NOT NULL DEFAULT now(),
    joined_epoch  BIGINT NOT NULL,
    PRIMARY KEY (run_id, hotkey)
);
CREATE INDEX miners_by_stage ON miners (run_id, stage) WHERE status = 'active';

CREATE TABLE samples (
    run_id          BIGINT NOT NULL REFERENCES runs(id),
    id              BIGSERIAL PRIMARY KEY,
    epoch           BIGINT NOT NULL,
    status          TEXT NOT NULL CHECK (status IN ('forward', 'backward', 'done', 'abandoned')),
    loss            DOUBLE PRECISION,
    sequence_losses DOUBLE PRECISION[],
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at    TIMESTAMPTZ
);
CREATE INDEX samples_by_epoch ON samples (run_id, epoch, id);

-- One row per hop attempt. A re-routed hop is a new attempt; the old row keeps its history.
CREATE TABLE tasks (
    id             BIGSERIAL PRIMARY KEY,
    run_id         BIGINT NOT NULL REFERENCES runs(id),
    epoch          BIGINT NOT NULL,
    sample_id      BIGINT NOT NULL REFERENCES samples(id),
    stage          INTEGER NOT NULL,
    direction      TEXT NOT NULL CHECK (direction IN ('forward', 'backward')),
    attempt        INTEGER NOT NULL DEFAULT 0,
    miner          TEXT NOT NULL,
    status         TEXT NOT NULL
                   CHECK (status IN ('pending', 'leased', 'done', 'expired', 'failed', 'abandoned')),
    lease          UUID,
    leased_until   TIMESTAMPTZ,
    input          JSONB,
    output         JSONB,
    staged_output  JSONB,
    inner_step     BIGINT,
    weights_digest TEXT,
    compute_ms     BIGINT,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    leased_at      TIMESTAMPTZ,
    completed_at   TIMESTAMPTZ,
    UNIQUE (sample_id, stage, direction, attempt)
);
CREATE INDEX tasks_open_by_miner ON tasks (run_id, miner, status) WHERE status IN ('pending', 'leased');
CREATE INDEX tasks_by_epoch ON tasks (run_id, epoch, id);
CREATE INDEX tasks_by_sample ON tasks (sample_id, stage, direction);
CREATE INDEX tasks_output_key ON tasks ((output->>'key'));
CREATE INDEX tasks_leased_until ON tasks (leased_until) WHERE status = 'leased';

CREATE TABLE pseudo_gradients (
    run_id      BIGINT NOT NULL REFERENCES runs(id),
    epoch       BIGINT NOT NULL,
    stage       INTEGER NOT NULL,
    partition   INTEGER NOT NULL,
    miner       TEXT NOT NULL,
    blob        JSONB NOT NULL,
    blake3      TEXT NOT NULL,
    weight      DOUBLE PRECISION NOT NULL,
    uploaded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch, stage, partition, miner)
);

CREATE TABLE partitions (
    run_id       BIGINT NOT NULL REFERENCES runs(id),
    epoch        BIGINT NOT NULL,
    stage        INTEGER NOT NULL,
    partition    INTEGER NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('open', 'accepted', 'disputed', 'unchanged')),
    -- Contributors frozen when merging starts: [{hotkey, weight, blob}] in merge order.
    contributions JSONB NOT NULL,
    accepted     JSONB,
    resolved_by  TEXT,
    PRIMARY KEY (run_id, epoch, stage, partition)
);

CREATE TABLE partition_owners (
    run_id      BIGINT NOT NULL REFERENCES runs(id),
    epoch       BIGINT NOT NULL,
    stage       INTEGER NOT NULL,
    partition   INTEGER NOT NULL,
    miner       TEXT NOT NULL,
    round       INTEGER NOT NULL,
    assigned_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch, stage, partition, miner)
);
CREATE INDEX partition_owners_by_miner ON partition_owners (run_id, epoch, miner);

CREATE TABLE merge_results (
    run_id       BIGINT NOT NULL REFERENCES runs(id),
    epoch        BIGINT NOT NULL,
    stage        INTEGER NOT NULL,
    partition    INTEGER NOT NULL,
    submitter    TEXT NOT NULL,
    blob         JSONB NOT NULL,
    blake3       TEXT NOT NULL,
    submitted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch, stage, partition, submitter)
);

CREATE TABLE disputes (
    id          BIGSERIAL PRIMARY KEY,
    run_id      BIGINT NOT NULL REFERENCES runs(id),
    epoch       BIGINT NOT NULL,
    stage       INTEGER NOT NULL,
    partition   INTEGER NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('open', 'settled')),
    opened_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    settled_by  TEXT,
    settled_hash TEXT,
    UNIQUE (run_id, epoch, stage, partition)
);

CREATE TABLE validator_scores (
    run_id       BIGINT NOT NULL REFERENCES runs(id),
    epoch        BIGINT NOT NULL,
    validator    TEXT NOT NULL,
    scores       JSONB NOT NULL,
    weights      JSONB,
    submitted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch, validator)
);

-- Objects that failed a consumer's check and were confirmed bad.
CREATE TABLE bad_objects (
    run_id      BIGINT NOT NULL REFERENCES runs(id),
    key         TEXT NOT NULL,
    reporter    TEXT NOT NULL,
    reason      TEXT NOT NULL,
    reported_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, key)
);

-- Replay cache of signed-request uuids, shared by every orchestrator process on this database.
-- Rows older than the clock window are deleted by the phase driver.
CREATE TABLE request_uuids (
    uuid    UUID PRIMARY KEY,
    seen_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX request_uuids_seen_at ON request_uuids (seen_at);

-- What each validator checked in an epoch and what it found, published for anyone to audit.
CREATE TABLE spot_checks (
    run_id       BIGINT NOT NULL REFERENCES runs(id),
    epoch        BIGINT NOT NULL,
    validator    TEXT NOT NULL,
    seed         TEXT NOT NULL,
    seed_block   BIGINT NOT NULL,
    checks       JSONB NOT NULL,
    submitted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch, validator)
);
