from services.runner import run_service
from services.watchdog.service import WatchdogService

run_service(WatchdogService, "watchdog")
