#!/usr/bin/env python3
"""Quartermaster's Kubernetes manifests: generate, render, validate and lint them offline.

    .venv/bin/python deploy/k8s/render.py check            # what CI runs; exit 1 on any finding
    .venv/bin/python deploy/k8s/render.py generate         # rewrite the generated files
    .venv/bin/python deploy/k8s/render.py render dev       # print an overlay, ready for kubectl

docs/deploy.md explains each step; the code is in deploy/k8s/qmk8s/.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qmk8s.cli import main

if __name__ == "__main__":
    sys.exit(main())
