"""`python -m services.serving`"""

from services.common.runtime import serve
from services.serving.app import NAME, create_app
from services.serving.settings import ServingSettings

if __name__ == "__main__":
    settings = ServingSettings()
    serve(create_app(settings), settings, NAME)
