from services.runner import run_service
from services.retrieval.service import RetrievalService

run_service(RetrievalService, "retrieval")
