-- When the phase driver last stepped. A process that takes the lead (after a restart, or when the
-- last leader died) finds how long nobody drove the run and gives the current phase back the time
-- it had left then: miners could not reach a dead orchestrator, so a deadline that passed while it
-- was down must not end the phase before they can upload or merge.
ALTER TABLE runs ADD COLUMN driven_at TIMESTAMPTZ;

-- Every step writes driven_at; polls' view of the run depends on the other columns only.
DROP TRIGGER poll_view_run_changed ON runs;
CREATE TRIGGER poll_view_run_changed
    AFTER UPDATE OF epoch, phase, phase_started, phase_deadline, merge_round ON runs
    FOR EACH ROW EXECUTE FUNCTION poll_view_run();
