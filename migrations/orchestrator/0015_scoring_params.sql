-- The settings a validator scored an epoch with, published with its scores so that anyone can
-- recompute them from the public records (`iota validator audit --validator`). NULL: a
-- submission from before they were published.
ALTER TABLE validator_scores ADD COLUMN params JSONB;
