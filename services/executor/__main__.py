"""`python -m services.executor` (QM_EXECUTOR_CLUSTER names the cluster it runs)."""

from services.common.runtime import serve
from services.executor.app import create_app
from services.executor.settings import ExecutorSettings

if __name__ == "__main__":
    settings = ExecutorSettings()
    serve(create_app(settings), settings, f"executor/{settings.executor_cluster}")
