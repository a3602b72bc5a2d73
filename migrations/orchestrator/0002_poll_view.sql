-- Most work polls find nothing to do. Each orchestrator process answers those from a view in
-- its memory (each active miner's stage and whether it has an open task, and the epoch status),
-- and these notifications keep every process's view current. Payloads: '<run> m <hotkey>' when
-- something a miner's poll depends on changed, '<run> s' when the epoch status did.

CREATE FUNCTION poll_view_miner() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('iota_poll_view', NEW.run_id || ' m ' || NEW.hotkey);
    RETURN NULL;
END $$;

CREATE TRIGGER poll_view_miner_inserted AFTER INSERT ON miners
    FOR EACH ROW EXECUTE FUNCTION poll_view_miner();
-- Not on last_seen: polls touch it all the time and the view does not depend on it.
CREATE TRIGGER poll_view_miner_changed AFTER UPDATE OF stage, status ON miners
    FOR EACH ROW EXECUTE FUNCTION poll_view_miner();

CREATE FUNCTION poll_view_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('iota_poll_view', NEW.run_id || ' m ' || NEW.miner);
    IF TG_OP = 'UPDATE' AND OLD.miner IS DISTINCT FROM NEW.miner THEN
        PERFORM pg_notify('iota_poll_view', OLD.run_id || ' m ' || OLD.miner);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER poll_view_task_inserted AFTER INSERT ON tasks
    FOR EACH ROW WHEN (NEW.status IN ('pending', 'leased'))
    EXECUTE FUNCTION poll_view_task();
CREATE TRIGGER poll_view_task_changed AFTER UPDATE OF status, miner ON tasks
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.miner IS DISTINCT FROM NEW.miner)
    EXECUTE FUNCTION poll_view_task();

CREATE FUNCTION poll_view_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('iota_poll_view', NEW.id || ' s');
    RETURN NULL;
END $$;

CREATE TRIGGER poll_view_run_changed AFTER UPDATE ON runs
    FOR EACH ROW EXECUTE FUNCTION poll_view_run();

CREATE FUNCTION poll_view_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('iota_poll_view', NEW.run_id || ' s');
    RETURN NULL;
END $$;

CREATE TRIGGER poll_view_epoch_inserted AFTER INSERT ON epochs
    FOR EACH ROW EXECUTE FUNCTION poll_view_epoch();
CREATE TRIGGER poll_view_epoch_changed AFTER UPDATE OF samples_started, samples_completed ON epochs
    FOR EACH ROW EXECUTE FUNCTION poll_view_epoch();
