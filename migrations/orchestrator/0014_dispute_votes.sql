-- Validators' votes on disputes: the hash each recomputed. A dispute settles when the voters of
-- one hash hold more than half the stake of the subnet's validator permit holders, so no single
-- small validator decides which merge becomes everyone's weights.
CREATE TABLE dispute_votes (
    dispute_id BIGINT NOT NULL REFERENCES disputes(id) ON DELETE CASCADE,
    validator  TEXT NOT NULL,
    blake3     TEXT NOT NULL,
    voted_at   TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (dispute_id, validator)
);
