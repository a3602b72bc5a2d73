-- The latest epoch in which a miner's work has ended: by its first pseudo-gradient partition,
-- or by a restart after it had completed hops of the epoch. Validators replay every hop a miner
-- completed in an epoch against its pseudo-gradient, so no hop of that epoch may be routed to,
-- leased to or completed by it afterwards.
ALTER TABLE miners ADD COLUMN ended_epoch BIGINT;

-- Whether a miner whose work ended uploaded a pseudo-gradient (the uploading phase's quorum
-- waits only for miners that may still upload one).
CREATE INDEX pseudo_gradients_by_miner ON pseudo_gradients (run_id, epoch, miner);
