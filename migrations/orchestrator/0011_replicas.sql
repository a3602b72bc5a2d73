-- Every orchestrator process serving this database, with the schema it was built for: a newer
-- version refuses to migrate while a replica of an older one still beats here, since the older
-- code would go on writing rows the new schema reads differently.
CREATE TABLE orchestrator_replicas (
    id UUID PRIMARY KEY,
    host TEXT NOT NULL,
    address TEXT NOT NULL,
    pid BIGINT NOT NULL,
    version TEXT NOT NULL,
    schema_version BIGINT NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX orchestrator_replicas_last_seen ON orchestrator_replicas (last_seen);
