"""BFCL v4 multi_turn_base as an outside benchmark (``python -m scripts.bench.bfcl``): ``official`` loads the
pinned bfcl-eval wheel's cases, function docs, simulated APIs and multi-turn checker (and imports nothing of
Magnitude); ``systems`` drives a case through ``/v1/responses``, a chat-completions loop on the gateway and the
same loop on llama-server; ``__main__`` starts the stack and prints the table."""
