"""`python -m services.queue`"""

from services.common.runtime import serve
from services.queue.app import NAME, create_app
from services.queue.settings import QueueSettings

if __name__ == "__main__":
    settings = QueueSettings()
    serve(create_app(settings), settings, NAME)
