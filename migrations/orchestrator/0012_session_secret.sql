-- Each run's secret for session keys: a session's key is a keyed BLAKE3 hash of its token and
-- the caller's public key under this secret, so every replica of the run computes it again and
-- none stores or looks up a session. 32 bytes from two v4 UUIDs (PostgreSQL's strong random
-- source, 244 random bits), drawn once per run.
ALTER TABLE runs ADD COLUMN session_secret BYTEA NOT NULL
    DEFAULT decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');
