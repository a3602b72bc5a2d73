-- The settings an epoch was scored with, published with its scores so that anyone can recompute
-- them (`iota validator audit --validator`). NULL: scored before they were kept.
ALTER TABLE scored_epochs ADD COLUMN params JSONB;
