from services.runner import run_service
from services.gateway.service import GatewayService

run_service(GatewayService, "gateway")
