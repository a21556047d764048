"""`python -m services.gateway`"""

from services.common.runtime import serve
from services.gateway.app import NAME, create_app
from services.gateway.settings import GatewaySettings

if __name__ == "__main__":
    settings = GatewaySettings()
    serve(create_app(settings), settings, NAME)
