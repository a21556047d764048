"""`python -m services.meter`"""

from services.common.runtime import serve
from services.meter.app import NAME, create_app
from services.meter.settings import MeterSettings

if __name__ == "__main__":
    settings = MeterSettings()
    serve(create_app(settings), settings, NAME)
