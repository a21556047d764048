-- The relay's periodic scan only takes rows old enough that no fast-path publish owns them.
ALTER TABLE outbox ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
