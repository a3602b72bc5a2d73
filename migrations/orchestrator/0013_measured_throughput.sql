-- Each miner's throughput as the orchestrator measures it from the hops it completes (see
-- `domain::throughput`), which routing and the explorer (`/v1/miners`, `/v1/stages`, the
-- dashboard) use in place of the throughput a miner claims, once there is one. (A newcomer's
-- stage is chosen before it has any hop: by its claim, capped at four times the run's median.)
-- Its own table, so that recording a completion locks no row of `miners` (which completions of
-- the same miner hold shared).
CREATE TABLE miner_throughput (
    run_id       BIGINT NOT NULL,
    miner        TEXT NOT NULL,
    tokens_per_s DOUBLE PRECISION NOT NULL,
    last_done_at TIMESTAMPTZ NOT NULL,
    hops         BIGINT NOT NULL,
    PRIMARY KEY (run_id, miner)
);
