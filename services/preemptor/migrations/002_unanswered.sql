-- When an alert went out for a stop order no run end has answered: one alert per preemption.
ALTER TABLE preemptions ADD COLUMN alerted_at timestamptz;
CREATE INDEX preemptions_unanswered ON preemptions (ordered_at) WHERE state = 'ordered' AND alerted_at IS NULL;
