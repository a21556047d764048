"""The web dashboard the gateway serves at /ui: docs/dashboard.md."""
