"""`python -m services.scheduler`"""

from services.common.runtime import serve
from services.scheduler.app import NAME, create_app
from services.scheduler.settings import SchedulerSettings

if __name__ == "__main__":
    settings = SchedulerSettings()
    serve(create_app(settings), settings, NAME)
