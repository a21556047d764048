"""`python -m services.preemptor`"""

from services.common.runtime import serve
from services.preemptor.app import NAME, create_app
from services.preemptor.settings import PreemptorSettings

if __name__ == "__main__":
    settings = PreemptorSettings()
    serve(create_app(settings), settings, NAME)
