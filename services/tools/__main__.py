from services.runner import run_service
from services.tools.service import ToolService

run_service(ToolService, "tools")
