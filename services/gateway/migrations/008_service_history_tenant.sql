-- A service name is free again once deleted, for any tenant: its history rows say whose
-- service they were, and a service's page shows only its owner's.
ALTER TABLE service_history ADD COLUMN tenant text;
