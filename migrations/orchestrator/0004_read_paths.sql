-- What the public read routes and the per-miner counts need, so that their cost follows what
-- they return rather than the length of the run.

-- Mean loss of each finished epoch, stored when it ends (`GET /v1/loss` aggregated every sample
-- of the run on each request); NULL while the epoch runs.
ALTER TABLE epochs ADD COLUMN loss_samples BIGINT, ADD COLUMN loss_mean DOUBLE PRECISION;
UPDATE epochs e SET loss_samples = coalesce(s.n, 0), loss_mean = s.mean
FROM (SELECT x.run_id, x.epoch, l.n, l.mean FROM epochs x
      LEFT JOIN LATERAL (SELECT count(loss) AS n, avg(loss) AS mean FROM samples
                         WHERE run_id = x.run_id AND epoch = x.epoch AND loss IS NOT NULL) l
      ON true) s
WHERE e.run_id = s.run_id AND e.epoch = s.epoch AND e.ended_at IS NOT NULL;

-- A miner's completed hops in an epoch (the miners list, spot-check tasks, pseudo-gradient
-- weights).
CREATE INDEX tasks_done_by_miner ON tasks (run_id, epoch, miner) WHERE status = 'done';

-- A partition's latest accepted merge (current weights, an epoch's start weights, merge bases).
CREATE INDEX partitions_accepted_latest ON partitions (run_id, stage, partition, epoch DESC)
    WHERE state = 'accepted';
