-- SLO breaches (services.health.slowatch): one row per breach of an SLO's alert level, from
-- its one alert.raised until the level stops firing. At most one open per SLO and level, so
-- a restart or a new holder of the lease finds it and does not alert again.
CREATE TABLE slo_breaches (
    breach_id text PRIMARY KEY,
    slo text NOT NULL,
    level text NOT NULL,
    severity text NOT NULL,
    suggested_action text NOT NULL,
    opened_at timestamptz NOT NULL,
    count bigint NOT NULL,
    closed_at timestamptz
);
CREATE UNIQUE INDEX slo_breaches_open ON slo_breaches (slo, level) WHERE closed_at IS NULL;
