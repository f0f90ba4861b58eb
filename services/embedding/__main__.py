from services.runner import run_service
from services.embedding.service import EmbeddingService

run_service(EmbeddingService, "embedding")
