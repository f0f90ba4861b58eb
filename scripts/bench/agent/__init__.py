"""The agent benchmark (``python -m scripts.bench.agent``): task success of Magnitude's agent against a plain
OpenAI-style tool loop on llama-server. ``tasks`` loads the corpus (``data/agent_<set>.json``), ``grader``
checks answers without any of the agent's code, ``runners`` runs the tasks on each system, ``__main__`` is the
command line. Nothing is imported here, so the grader stays apart from the agent."""
