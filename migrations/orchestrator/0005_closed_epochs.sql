-- The latest epoch in which a miner's work has ended: by its first pseudo-gradient partition,
-- or by a restart after it had completed hops of the epoch. Validators replay every hop a miner
-- completed in an epoch against its pseudo-gradient, so no hop of that epoch may be routed to,
-- leased to or completed by it afterwards.
ALTER TABLE miners ADD COLUMN ended_epoch BIGINT;

-- Whether a miner whose work ended uploaded a pseudo-gradient (the uploading phase's quorum
-- waits only for miners that may still upload one).
CREATE INDEX pseudo_gradients_by_miner ON pseudo_gradients (run_id, epoch, miner);

-- Samples given up on, per epoch, so that the status every poll reads says how many are still
-- travelling (started - completed - abandoned): miners upload their pseudo-gradient, which ends
-- their work in the epoch, once none is.
ALTER TABLE epochs ADD COLUMN samples_abandoned BIGINT NOT NULL DEFAULT 0;
UPDATE epochs e SET samples_abandoned = (SELECT count(*) FROM samples s
    WHERE s.run_id = e.run_id AND s.epoch = e.epoch AND s.status = 'abandoned');
DROP TRIGGER poll_view_epoch_changed ON epochs;
CREATE TRIGGER poll_view_epoch_changed
    AFTER UPDATE OF samples_started, samples_completed, samples_abandoned ON epochs
    FOR EACH ROW EXECUTE FUNCTION poll_view_epoch();
