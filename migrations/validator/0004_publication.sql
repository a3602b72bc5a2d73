-- When an epoch's spot checks and scores reached the orchestrator. NULL: not yet, and each pass
-- tries again (they are rebuilt from the rows stored with the epoch). Epochs scored before this
-- column existed were published when they were scored (or never will be): they count as done.
ALTER TABLE scored_epochs ADD COLUMN published_at TIMESTAMPTZ DEFAULT now();
ALTER TABLE scored_epochs ALTER COLUMN published_at DROP DEFAULT;
