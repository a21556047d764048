"""`python -m tests.kubeapi [--port N] [--node NAME] [--auto-kubelet]`: serve the double."""

from tests.kubeapi.server import main

main()
