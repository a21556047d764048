-- What each cluster's newest inventory (cluster.capacity) said about prices: the prices its
-- executor announced ([[accelerator type, tier, millionths an accelerator-hour], ...]) and
-- each node's price tier ({node id: tier}). A restarted meter prices placements with them
-- until the next inventory comes, instead of billing every node as on-demand.
CREATE TABLE announced (
    cluster text PRIMARY KEY,
    prices jsonb NOT NULL,
    tiers jsonb NOT NULL
);
