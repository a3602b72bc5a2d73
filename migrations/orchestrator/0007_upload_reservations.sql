-- A miner about to upload its pseudo-gradient reserves the upload before the uploading phase's
-- deadline. While a reserving miner has not uploaded every partition, the phase stays open past
-- its deadline, for at most one more phase length: a large upload that started in time is not
-- thrown away because the deadline passed while its bytes were on the way.
CREATE TABLE upload_reservations (
    run_id      BIGINT NOT NULL REFERENCES runs(id),
    epoch       BIGINT NOT NULL,
    miner       TEXT NOT NULL,
    reserved_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (run_id, epoch, miner)
);
