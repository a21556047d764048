-- When the newest autoscale decision applied to each pool was taken: an older one read again
-- (a consumer group replaying from an old offset) is not applied over it.
ALTER TABLE pool_sizes ADD COLUMN applied_at timestamptz;
