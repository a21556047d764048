"""Generator, renderer and checker of deploy/k8s (entry point: deploy/k8s/render.py)."""
