from services.runner import run_service
from services.optimizer.service import OptimizerService

run_service(OptimizerService, "optimizer")
