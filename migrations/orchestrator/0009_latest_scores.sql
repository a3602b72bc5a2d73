-- Each validator's latest scores (`GET /v1/scores`, the dashboard): one index probe per validator
-- instead of reading and sorting every submission of the run.
CREATE INDEX validator_scores_latest ON validator_scores (run_id, validator, epoch DESC);
