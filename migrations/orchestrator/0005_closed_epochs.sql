-- A miner's first pseudo-gradient partition of an epoch ends its work in that epoch: validators
-- replay its completed hops against that pseudo-gradient, so no hop may complete after it.
-- Routing and leasing ask, per miner, whether it has uploaded one.
CREATE INDEX pseudo_gradients_by_miner ON pseudo_gradients (run_id, epoch, miner);
