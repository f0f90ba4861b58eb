from services.runner import run_service
from services.inference.service import InferenceService

run_service(InferenceService, "inference")
