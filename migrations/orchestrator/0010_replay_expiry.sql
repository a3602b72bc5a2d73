-- Each recorded uuid carries how long it must be kept, set by the process that recorded it: runs
-- on one database share this table, and each run's driver pruned every row with its own run's
-- retention (the shortest won, so a slow replay of another run's upload could find its uuid
-- gone). Rows from before keep their hour.
ALTER TABLE request_uuids ADD COLUMN expires_at TIMESTAMPTZ;
UPDATE request_uuids SET expires_at = seen_at + interval '1 hour';
ALTER TABLE request_uuids ALTER COLUMN expires_at SET NOT NULL;
DROP INDEX IF EXISTS request_uuids_seen_at;
CREATE INDEX request_uuids_expires_at ON request_uuids (expires_at);
