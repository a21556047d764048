"""`python -m services.executor.edge` (QM_EDGE_FLEET names the robot fleet)."""

from services.common.runtime import serve
from services.executor.edge.app import EdgeSettings, create_app

if __name__ == "__main__":
    settings = EdgeSettings()
    serve(create_app(settings), settings, f"edge-{settings.edge_fleet}")
