"""The executor's `kubernetes` backend: placements become pods on a real cluster, and what the
pods and nodes do becomes the events the rest of Quartermaster reads."""
