"""`python -m services.autoscaler`"""

from services.autoscaler.app import NAME, create_app
from services.autoscaler.settings import AutoscalerSettings
from services.common.runtime import serve

if __name__ == "__main__":
    settings = AutoscalerSettings()
    serve(create_app(settings), settings, NAME)
