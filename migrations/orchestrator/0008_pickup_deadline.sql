-- A routed hop waits for its miner to lease it until `leased_until` (two leases from routing), then
-- moves as a lapsed lease does: a miner that heartbeats but never polls no longer holds the hops
-- routed to it until the epoch ends. Hops routed before this migration get the pick-up time from
-- now.
UPDATE tasks SET leased_until = now() + interval '10 minutes'
WHERE status = 'pending' AND leased_until IS NULL;
DROP INDEX IF EXISTS tasks_leased_until;
CREATE INDEX tasks_open_until ON tasks (leased_until) WHERE status IN ('pending', 'leased');
