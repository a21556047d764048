"""`python -m services.health`"""

from services.common.runtime import serve
from services.health.app import NAME, create_app
from services.health.settings import HealthSettings

if __name__ == "__main__":
    settings = HealthSettings()
    serve(create_app(settings), settings, NAME)
